"""8-bit AdamW and the host-offloaded optimizer against torch's AdamW."""
import copy

import pytest
import torch

from kiln.train.adam8bit import BLOCK, MIN_8BIT, AdamW8bit, _Codebook, dynamic_codebook, state_bytes
from kiln.train.host_optimizer import HostOptimizer
from kiln.memory.measure import optimizer_state_tensors, tensor_bytes
from kiln.models import build_model
from kiln.train.masked import MaskedAdam, MaskedSGD, optimizer_step
from kiln.train.optim import OptimConfig, build_optimizer, param_groups

from tests.memory.conftest import MODELS


@pytest.mark.parametrize("signed", [True, False])
def test_codebook_encodes_to_the_nearest_entry(signed):
    values = dynamic_codebook(signed)
    assert len(values) == (255 if signed else 256) and torch.all(values[1:] > values[:-1])
    assert values.max() == 1.0 and 0.0 in values.tolist() and (values.min() == -1.0 if signed else True)
    book = _Codebook(signed, "cpu")
    x = torch.randn(300, BLOCK) * torch.exp(3 * torch.randn(300, BLOCK))  # 20 decades of magnitudes
    x = x if signed else x.abs()
    codes, scale = book.encode(x)
    nearest = torch.bucketize(x / scale[:, None], (values[1:] + values[:-1]) / 2)
    y = book.decode(codes, scale)
    # the nearest entry (ties, where float rounding puts x exactly between two entries, go either way)
    assert ((codes.long() != nearest).float().mean()) < 1e-4
    assert torch.all((y - x).abs() <= (book.decode(nearest.to(torch.uint8), scale) - x).abs() * (1 + 1e-6) + 1e-30)
    big = x.abs() > 0.1 * scale[:, None]  # within a decade of the block maximum: ~1% or better
    assert ((y - x).abs()[big] / x.abs()[big]).max() < 0.08
    assert ((y - x).norm() / x.norm()) < 0.02


def test_state_is_about_four_times_smaller():
    big = torch.nn.Parameter(torch.randn(1000, 96))  # 96k elements, not a multiple of the block
    small = torch.nn.Parameter(torch.randn(100))
    for p in (big, small):
        p.grad = torch.randn_like(p)
    q = AdamW8bit([big, small], lr=1e-3)
    q.step()
    ref = torch.optim.AdamW([copy.deepcopy(big), copy.deepcopy(small)], lr=1e-3)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    ref.step()
    got = tensor_bytes(optimizer_state_tensors(q))
    assert got == state_bytes(big.numel()) + state_bytes(small.numel())
    # fp32 moments and the 4-byte step count, a device tensor so that a withheld step needs no host sync
    assert state_bytes(small.numel()) == 8 * small.numel() + 4 and small.numel() < MIN_8BIT
    fp32 = sum(8 * p.numel() for p in (big, small))
    assert 3.9 < fp32 / got < 4.0


def test_small_tensors_step_like_adamw():
    p = torch.nn.Parameter(torch.randn(300))
    r = torch.nn.Parameter(p.detach().clone())
    q = AdamW8bit([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref = torch.optim.AdamW([r], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(5):
        g = torch.randn(300)
        p.grad, r.grad = g.clone(), g.clone()
        q.step()
        ref.step()
    torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def bigram_batches(n, vocab=64, B=8, T=32, seed=0):
    """Sequences from one fixed random bigram table (seed picks the samples): a task a 2-layer model learns in a
    few dozen steps."""
    table = torch.softmax(3 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1234)), dim=-1)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.zeros(B, T + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (B,), generator=g)
        for t in range(T):
            x[:, t + 1] = torch.multinomial(table[x[:, t]], 1, generator=g).squeeze(1)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def train_losses(name, batches, held_out):
    torch.manual_seed(0)
    model = build_model(MODELS["gpt2"](vocab_size=64, d_model=128))
    opt = build_optimizer(param_groups(model, 0.1), OptimConfig(name=name, lr=3e-3))
    for x, y in batches:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        return sum(model(x, y).item() for x, y in held_out) / len(held_out)


def test_adamw8bit_trains_like_adamw():
    batches, held_out = bigram_batches(80), bigram_batches(4, seed=1)
    ref, got = train_losses("adamw", batches, held_out), train_losses("adamw8bit", batches, held_out)
    assert ref < 3.0  # learned something (uniform is ln 64 = 4.16)
    assert abs(got / ref - 1) < 0.02, (got, ref)


def test_adamw8bit_state_dict_round_trip():
    p = torch.nn.Parameter(torch.randn(8192))
    opt = AdamW8bit([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    twin = torch.nn.Parameter(p.detach().clone())
    opt2 = AdamW8bit([twin], lr=1e-3)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    g = torch.randn_like(p)
    p.grad, twin.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, twin)


def _quadratic_grads(params, target):
    return [2 * (p.detach() - t) for p, t in zip(params, target)]


def test_host_optimizer_matches_adamw_exactly():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    cfg = OptimConfig(lr=1e-2)
    host = build_optimizer([{"params": params, "weight_decay": 0.1}], OptimConfig(lr=1e-2, offload="host"))
    ref = build_optimizer([{"params": twins, "weight_decay": 0.1}], cfg)
    assert isinstance(host, HostOptimizer)
    target = [torch.randn_like(p) for p in params]
    for _ in range(4):
        for p, g in zip(params, _quadratic_grads(params, target)):
            p.grad = g
        for p, g in zip(twins, _quadratic_grads(twins, target)):
            p.grad = g
        host.step()
        ref.step()
        host.zero_grad()
        ref.zero_grad()
    for p, t in zip(params, twins):
        assert torch.equal(p, t)
    assert optimizer_state_tensors(host) == []  # nothing on the device


def test_host_async_is_one_update_behind():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(128))]
    host = build_optimizer([{"params": params, "weight_decay": 0.0}], OptimConfig(lr=1e-2, offload="host-async"))
    assert isinstance(host, HostOptimizer)
    twin = [torch.nn.Parameter(params[0].detach().clone())]
    ref = torch.optim.AdamW(twin, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True)  # OptimConfig's
    target = [torch.randn(128)]
    history = [params[0].detach().clone()]
    for _ in range(5):
        g = _quadratic_grads(params, target)  # gradients at the (stale) parameters the model has
        params[0].grad = g[0]
        host.step()
        history.append(params[0].detach().clone())
        twin[0].grad = g[0].clone()  # the reference applies the same gradients, without delay
        ref.step()
    # after step k the device holds the result of update k-1
    assert torch.equal(history[1], history[0])
    host.flush()
    assert torch.equal(params[0], twin[0])
    state = host.state_dict()
    assert set(state) == {"inner", "masters", "mode"}


def test_adamw8bit_load_keeps_uint8_codes_and_device_step():
    """torch's load_state_dict casts a float parameter's state to its dtype: the codes came back as fp32 (4x)."""
    p = torch.nn.Parameter(torch.randn(8192))
    opt = AdamW8bit([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    twin = AdamW8bit([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["step"] = 1.0  # as checkpoints before the step count moved to the device held it
    twin.load_state_dict(saved)
    state = next(iter(twin.state.values()))
    assert state["m_codes"].dtype == state["v_codes"].dtype == torch.uint8
    assert state["step"].dtype == torch.float32 and state["step"].item() == 1.0
    assert tensor_bytes(optimizer_state_tensors(twin)) == state_bytes(p.numel())


# ---------------------------------------------------------------- withheld steps: exact, decided on the device

# (optim.name, implementation, other OptimConfig fields): every optimizer build_optimizer makes
SKIP_CASES = [(name, impl, {}) for name in ("adamw", "adam", "sgd") for impl in ("fused", "foreach", "loop")]
SKIP_CASES += [("sgd", impl, extra) for impl in ("fused", "foreach", "loop")
               for extra in ({"nesterov": True}, {"momentum": 0.0})]
SKIP_CASES += [("adamw8bit", "auto", {})]


def _skip_ids(case):
    name, impl, extra = case
    return "-".join([name, impl, *(f"{k}={v}" for k, v in extra.items())])


def _tensors(obj):
    """Every tensor in a (nested) state dict, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _snapshot(optimizer, params):
    """Parameters and every state tensor (HostOptimizer: inner state and masters, after a flush)."""
    return [t.detach().clone() for t in _tensors([params, optimizer.state_dict()])]


def _states(optimizer):
    return list(getattr(optimizer, "inner", optimizer).state.values())


def _assert_same_bits(got, want):
    """Bit for bit: torch.equal would let -0.0 pass for +0.0, and fail NaN against itself."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), i
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), i


def _skip_rig(name, impl, extra, offload):
    """A matrix of ≥ MIN_8BIT elements (AdamW8bit's 8-bit path) with weight decay, a vector without. Eight entries
    of the matrix are -0.0 and never get a gradient: a withheld step must add exactly -0.0 to them, not +0.0."""
    torch.manual_seed(0)
    w, b = torch.randn(80, 64), torch.randn(100)
    w[0, :8] = -0.0
    params = [torch.nn.Parameter(w), torch.nn.Parameter(b)]
    cfg = OptimConfig(name=name, implementation=impl, offload=offload, lr=1e-2, **extra)
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    return build_optimizer(groups, cfg), params


def _clean_grads(params, t):
    g = torch.Generator().manual_seed(100 + t)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    grads[0][0, :8] = 0.0
    return grads


def _bad_grads(params):
    """What a withheld step sees: overflowed, NaN and huge gradients (a spike's are finite but never applied)."""
    grads = [1e30 * torch.randn(p.shape) for p in params]
    grads[0][1, :5] = float("inf")
    grads[0][2, :5] = float("nan")
    grads[1][:3] = -float("inf")
    return grads


@pytest.mark.parametrize("offload", ["none", "host", "host-async"])
@pytest.mark.parametrize("skip_at", [0, 2], ids=["first-step", "third-step"])
@pytest.mark.parametrize("case", SKIP_CASES, ids=_skip_ids)
def test_withheld_step_is_exact(case, skip_at, offload):
    """A withheld step leaves parameters and every state tensor bit for bit; the steps after it equal those of an
    optimizer that never saw it (a reference that simply did not step)."""
    name, impl, extra = case
    opt, params = _skip_rig(name, impl, extra, offload)
    ref, ref_params = _skip_rig(name, impl, extra, offload)
    clean, withhold = torch.zeros(()), torch.ones(())
    for t in range(4):
        if t == skip_at:
            before = _snapshot(opt, params)
            for p, g in zip(params, _bad_grads(params)):
                p.grad = g
            optimizer_step(opt, withhold)
            after = _snapshot(opt, params)
            if t == 0:  # the state is made on the first step, withheld or not: as made, step counts 0
                after, before = after[:len(params)], before[:len(params)]
                steps = [s["step"] for s in _states(opt) if "step" in s]
                assert all(float(s) == 0.0 for s in steps) and (steps or name == "sgd")
            _assert_same_bits(after, before)
            continue
        for ps, o in ((params, opt), (ref_params, ref)):
            for p, g in zip(ps, _clean_grads(ps, t)):
                p.grad = g
            optimizer_step(o, clean)
    _assert_same_bits(_snapshot(opt, params), _snapshot(ref, ref_params))
    assert params[0][0, :8].signbit().all()  # the -0.0 entries: still -0.0 (the test would see +0.0)


@pytest.mark.parametrize("impl", ["foreach", "loop"])
@pytest.mark.parametrize("name,extra", [("adamw", {}), ("adam", {}), ("sgd", {}), ("sgd", {"nesterov": True}),
                                        ("sgd", {"momentum": 0.0})], ids=["adamw", "adam", "sgd", "nesterov", "plain"])
def test_masked_optimizers_match_torch(name, extra, impl):
    """kiln's foreach/loop Adam, AdamW and SGD against torch's, 8 steps in fp32, weight decay on one group."""
    opt, params = _skip_rig(name, impl, extra, "none")
    assert isinstance(opt, MaskedSGD if name == "sgd" else MaskedAdam)
    _, ref_params = _skip_rig(name, impl, extra, "none")
    groups = [{"params": ref_params[:1], "weight_decay": 0.1}, {"params": ref_params[1:], "weight_decay": 0.0}]
    kw = dict(lr=1e-2, foreach=impl == "foreach")
    if name == "sgd":
        cfg = OptimConfig(**extra)
        ref = torch.optim.SGD(groups, momentum=cfg.momentum, nesterov=cfg.nesterov, **kw)
    else:
        ref = (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(groups, betas=(0.9, 0.95), eps=1e-8, **kw)
    for t in range(8):
        for ps in (params, ref_params):
            for p, g in zip(ps, _clean_grads(ps, t)):
                p.grad = g
        opt.step()
        ref.step()
        ours, torchs = [*params, *_tensors(opt.state_dict())], [*ref_params, *_tensors(ref.state_dict())]
        for got, want in zip(ours, torchs, strict=True):  # the same state: step, exp_avg(_sq), momentum_buffer
            # 1e-6 relative; near zero, 1e-6 of the tensor's largest entry (one rounding of a 1e-2 update moves
            # an entry of 1e-3 by 1e-5 of itself)
            scale = want.abs().max().item()
            torch.testing.assert_close(got.to(want.device), want, rtol=1e-6, atol=1e-6 * scale)
    moved = (params[0] - _skip_rig(name, impl, extra, "none")[1][0]).abs().max()
    assert moved > 1e-3  # the comparison above is over parameters that did move
