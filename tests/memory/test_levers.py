"""Recompute, chunked loss and activation offload change memory, never the numbers."""
import pytest
import torch

from kiln.memory.chunked_loss import ChunkedLMLoss
from kiln.memory.estimate import Job, Target, block_flops, recompute_plan, saved_tensors
from kiln.memory.offload import apply_offload, parse_blocks
from kiln.memory.recompute import apply_recompute, plan_for, remove_recompute, solve_budget
from kiln.models import IGNORE_INDEX, build_model
from kiln.models.transformer import LMLoss

from tests.memory.conftest import MODELS


def grads_of(model, x, y, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3_moe"])
@pytest.mark.parametrize("plan", [("full", "full", "full"), ("full", "seg", "seg"), ("selective",) * 3,
                                  ("selective", "full", "none")])
def test_recompute_keeps_loss_and_gradients(arch, plan):
    """(Qwen3-MoE: the routing, run again in the backward, and the load-balancing loss in the loss.)"""
    cfg = MODELS[arch](n_layer=3, dropout=0.1)
    model = build_model(cfg)
    x, y = torch.randint(0, 200, (2, 24)), torch.randint(0, 200, (2, 24))
    torch.manual_seed(1)
    ref_loss, ref = grads_of(model, x, y)
    apply_recompute(model, plan)
    torch.manual_seed(1)  # same dropout masks: checkpoint replays the RNG state
    loss, got = grads_of(model, x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    names = [n for n, _ in model.named_parameters()]
    remove_recompute(model)
    assert type(model.blocks[0]) is type(build_model(cfg).blocks[0])  # the block's own class again
    assert names == [n for n, _ in model.named_parameters()]  # parameter names never changed
    assert set(model.state_dict()) == set(build_model(cfg).state_dict())


@pytest.mark.parametrize("plan", [("full", "seg", "seg", "full"), ("selective",) * 4, ("none", "full", "seg", "none")])
def test_recomputed_blocks_stay_modules_whose_hooks_fire(plan):
    """Every block, the later blocks of a checkpointed segment included, computes inside a call of its own module:
    forward hooks (FSDP2's all-gathers, the NaN tracer's hooks) see it, and see it once."""
    model = build_model(MODELS["gpt2"](n_layer=4))
    apply_recompute(model, plan)
    computed = {i: 0 for i in range(4)}
    for i, block in enumerate(model.blocks):
        assert isinstance(block, torch.nn.Module)

        def hook(module, args, output, i=i):
            computed[i] += not torch.equal(output, args[0])  # a pass-through call returns its input
        block.register_forward_hook(hook)
    x, y = torch.randint(0, 200, (2, 16)), torch.randint(0, 200, (2, 16))
    model(x, y)
    assert all(n == 1 for n in computed.values()), computed


def test_recompute_plans():
    assert recompute_plan("every_k", 5, 2) == ("full", "seg", "full", "seg", "full")
    with pytest.raises(ValueError, match="no 'full' block"):
        apply_recompute(build_model(MODELS["gpt2"]()), ("seg", "full"))
    with pytest.raises(ValueError, match="recompute_budget"):
        plan_for("budget", 2, "", None)


def test_budget_picks_least_recompute_that_fits():
    cfg = MODELS["gpt2"](n_layer=6)
    job = Job(model=cfg, micro_batch=4, seq_len=48, precision="fp32", target=Target("cpu"))
    sizes = {p: sum(saved_tensors(Job(**{**job.__dict__, "recompute": (p,) * 6}))[1][0].values())
             for p in ("none", "selective", "full")}
    mm, attn = block_flops(cfg, 4, 48, True)
    assert solve_budget(job, 6 * sizes["none"]) == ("none",) * 6
    plan = solve_budget(job, 3 * sizes["none"] + 3 * sizes["full"])
    used = sum(sizes[p] for p in plan)
    assert used <= 3 * sizes["none"] + 3 * sizes["full"]
    # no cheaper split fits: brute force over the counts
    cost = sum({"none": 0, "selective": attn, "full": mm + attn}[p] for p in plan)
    for nf in range(7):
        for ns in range(7 - nf):
            size = (6 - nf - ns) * sizes["none"] + ns * sizes["selective"] + nf * sizes["full"]
            if size <= 3 * sizes["none"] + 3 * sizes["full"]:
                assert ns * attn + nf * (mm + attn) >= cost
    with pytest.raises(ValueError, match="below what full recomputation keeps"):
        solve_budget(job, sizes["full"])


@pytest.mark.parametrize("n,chunk", [(37, 8), (64, 64), (50, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_matches_lmloss(n, chunk, dtype):
    h = torch.randn(n, 48, dtype=dtype, requires_grad=True)
    w = (torch.randn(320, 48) * 0.2).to(dtype).requires_grad_()
    t = torch.randint(0, 320, (n,))
    t[::5] = IGNORE_INDEX
    ref = LMLoss()(h, w, t)
    (gh_ref, gw_ref) = torch.autograd.grad(ref, (h, w))
    got = ChunkedLMLoss(chunk)(h, w, t)
    (gh, gw) = torch.autograd.grad(got, (h, w))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(gh, gh_ref, **tol)
    torch.testing.assert_close(gw, gw_ref, **tol)


def test_chunked_loss_under_autocast_in_a_model():
    cfg = MODELS["llama"]()
    model = build_model(cfg)
    x, y = torch.randint(0, 200, (3, 40)), torch.randint(0, 200, (3, 40))
    ref_loss, ref = grads_of(model, x, y, autocast=True)
    model.loss = ChunkedLMLoss(32)
    loss, got = grads_of(model, x, y, autocast=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=5e-2, atol=2e-3, msg=name)


def test_offload_block_spec_and_cpu_pass_through():
    assert parse_blocks("none", 8) == frozenset()
    assert parse_blocks("all", 3) == {0, 1, 2}
    assert parse_blocks("0-2,5", 8) == {0, 1, 2, 5}
    with pytest.raises(ValueError, match="blocks run 0..3"):
        parse_blocks("2-7", 4)
    model = build_model(MODELS["gpt2"]())
    x, y = torch.randint(0, 200, (2, 24)), torch.randint(0, 200, (2, 24))
    ref_loss, ref = grads_of(model, x, y)
    hooks = apply_offload(model, {0, 1})
    loss, got = grads_of(model, x, y)
    assert hooks.offloaded_bytes == 0  # CPU tensors have no separate host memory to go to
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_frees_device_memory_and_keeps_gradients():
    cfg = MODELS["gpt2"](n_layer=4, d_model=256, n_head=4)
    model = build_model(cfg, "cuda")
    x = torch.randint(0, 200, (8, 64), device="cuda")
    y = torch.randint(0, 200, (8, 64), device="cuda")

    def held():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(x, y)
        torch.cuda.synchronize()
        return loss, torch.cuda.memory_allocated() - before

    ref_loss, ref_held = held()
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hooks = apply_offload(model, range(4))
    loss, off_held = held()
    loss.backward()
    assert hooks.offloaded_bytes > 0 and off_held < 0.5 * ref_held
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n])
