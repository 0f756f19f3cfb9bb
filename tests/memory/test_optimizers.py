"""8-bit AdamW and the host-offloaded optimizer against torch's AdamW."""
import copy

import pytest
import torch

from kiln.memory.adam8bit import BLOCK, MIN_8BIT, AdamW8bit, _Codebook, dynamic_codebook, state_bytes
from kiln.memory.host_optimizer import HostOptimizer
from kiln.memory.measure import optimizer_state_tensors, tensor_bytes
from kiln.models import build_model
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
    assert state_bytes(small.numel()) == 8 * small.numel() and small.numel() < MIN_8BIT
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
    host = HostOptimizer([{"params": params, "weight_decay": 0.0}], OptimConfig(lr=1e-2), "host-async")
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
