"""kiln.models.moe's experts: grouped_mm against the loop, the probe, the seam, the earlier layout's checkpoints."""
import pytest
import torch
import torch.nn.functional as F

from kiln.models.moe import MoE, experts, grouped_mm_works


def _float64_experts(w_fc, w_proj, h, counts):
    """Each row through its expert's SwiGLU in float64, one row at a time."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    out = torch.zeros(h.shape[0], w_proj.shape[1], dtype=torch.float64)
    for i, e in enumerate(expert.tolist()):
        gate, up = (w_fc[e].double() @ h[i].double()).chunk(2)
        out[i] = w_proj[e].double() @ (F.silu(gate) * up)
    return out


def test_the_probe_finds_grouped_mm_in_fp32_and_bf16_not_fp64():
    if not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm: every dtype takes the loop")
    assert grouped_mm_works("cpu", torch.float32) and grouped_mm_works("cpu", torch.bfloat16)
    assert not grouped_mm_works("cpu", torch.float64)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_experts_match_the_loop_forward_and_backward(dtype, tol):
    """An expert with no rows among uneven ones: grouped_mm and the loop against float64, values and gradients."""
    if not grouped_mm_works("cpu", dtype):
        pytest.skip(f"grouped_mm does not run in {dtype} here")
    torch.manual_seed(0)
    E, C, Fw = 5, 24, 16
    counts = torch.tensor([4, 0, 7, 1, 3])
    S = int(counts.sum())
    w_fc, w_proj = torch.randn(E, 2 * Fw, C) / 5, torch.randn(E, C, Fw) / 4
    h, g = torch.randn(S, C), torch.randn(S, C)
    want = _float64_experts(w_fc, w_proj, h, counts)
    grads = {}
    for grouped in (True, False):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (w_fc, w_proj, h)]
        y = experts(*leaves[:2], leaves[2], counts, grouped=grouped)
        assert y.dtype == dtype and y.shape == (S, C)
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
        y.float().mul(g).sum().backward()
        grads[grouped] = [t.grad.double() for t in leaves]
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert (grads[True][0][1] == 0).all()  # the expert with no rows: a zero gradient, not none


def test_the_moe_is_the_same_grouped_or_looped_and_dispatch_is_replaceable():
    torch.manual_seed(0)
    moe = MoE(32, n_experts=6, top_k=2, d_ff=20).train()
    x = torch.randn(2, 9, 32, requires_grad=True)
    outs = []
    for grouped in (None, False):
        moe.grouped = grouped
        y = moe(x)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        outs.append((y, gx, moe.routed))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-6)
    assert outs[0][2].tolist() == outs[1][2].tolist() and outs[0][2].sum() == 2 * 9 * 2
    seen = []
    local = moe.dispatch

    def spy(h, weights, chosen, counts):  # what expert parallelism puts in its place
        seen.append(counts)
        return local(h, weights, chosen, counts)

    moe.dispatch = spy
    torch.testing.assert_close(moe(x), outs[0][0])
    assert seen[0].tolist() == outs[0][2].tolist()


def test_a_state_dict_of_one_linear_per_expert_loads_stacked():
    torch.manual_seed(0)
    moe = MoE(16, n_experts=3, top_k=2, d_ff=8)
    old = {"router.weight": moe.router.weight.detach().clone()}
    for e in range(3):
        old[f"experts.{e}.fc.weight"] = torch.randn(16, 16)
        old[f"experts.{e}.proj.weight"] = torch.randn(16, 8)
    fresh = MoE(16, n_experts=3, top_k=2, d_ff=8)
    fresh.load_state_dict(dict(old))
    for e in range(3):
        assert torch.equal(fresh.experts.fc.weight[e], old[f"experts.{e}.fc.weight"])
        assert torch.equal(fresh.experts.proj.weight[e], old[f"experts.{e}.proj.weight"])


def test_widths_grouped_mm_cannot_take_fall_back_to_the_loop(monkeypatch):
    """grouped_mm wants 16-byte row strides: F=14 in fp32 (56 bytes) takes the loop, which reads the counts."""
    torch.manual_seed(0)
    w_fc, w_proj, h, counts = torch.randn(3, 28, 16), torch.randn(3, 16, 14), torch.randn(5, 16), torch.tensor([2, 0, 3])
    want = _float64_experts(w_fc, w_proj, h, counts)
    read = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: read.append(t) or t.numpy().tolist())
    torch.testing.assert_close(experts(w_fc, w_proj, h, counts).double(), want, rtol=1e-5, atol=1e-5)
    assert len(read) == 1


def test_a_checkpoint_of_the_per_expert_layout_exports_but_does_not_resume():
    from kiln.train.checkpoint import refuse_per_expert
    from kiln.models.moe import per_expert_key, stack_experts
    torch.manual_seed(0)
    moe = MoE(16, n_experts=3, top_k=2, d_ff=8)
    new = {f"blocks.1.mlp.{k}": v for k, v in moe.state_dict().items()}
    old = {k: v for k, v in new.items() if ".experts." not in k}
    for name in ("fc", "proj"):
        for e in range(3):
            old[f"blocks.1.mlp.experts.{e}.{name}.weight"] = new[f"blocks.1.mlp.experts.{name}.weight"][e]
    stacked = stack_experts(old)
    assert stacked.keys() == new.keys() and all(torch.equal(stacked[k], new[k]) for k in new)
    assert stack_experts(new) == new and per_expert_key(new) is None
    refuse_per_expert("run", new)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.experts\.0\.fc\.weight.*--model\.init=hf:DIR"):
        refuse_per_expert("run", old)
