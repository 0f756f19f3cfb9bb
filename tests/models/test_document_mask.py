"""Packed documents (kiln.models.documents): a window of several samples computes, token for token, what each
sample computes alone, in every family; the loss's gradient is the sum of the samples' gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.models import build_model
from kiln.models.config import ModelConfig
from kiln.models.documents import document_mask, positions, same_document
from kiln.models.transformer import IGNORE_INDEX

TINY = dict(n_layer=2, n_head=4, d_model=64, vocab_size=97, max_seq_len=32)
FAMILIES = {
    "gpt2": ModelConfig(preset="nano", arch="gpt2", **TINY),
    "llama": ModelConfig(preset="nano", arch="llama", n_kv_head=2, d_ff=96, **TINY),
    "qwen3": ModelConfig(preset="nano", arch="qwen3", n_kv_head=2, head_dim=16, d_ff=96, **TINY),
    "qwen3_moe": ModelConfig(preset="qwen3-moe-nano", n_kv_head=2, head_dim=16, n_experts=4, n_experts_active=2,
                             moe_d_ff=32, **TINY),
}
ROWS = [[5, 9, 1, 7], [22], [12, 10]]  # sample lengths per window of T = 22: a one-token sample, a whole window


def test_positions_and_mask_by_hand():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    assert positions(doc).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    m = document_mask(doc)
    assert m.shape == (2, 1, 6, 6)
    assert m[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                      [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert m[1, 0, 1].int().tolist() == [0, 1, 0, 0, 0, 0]
    # flex_attention's mask_mod of the same rule (context parallel's, the BlockMask's), on every (b, q, kv)
    b, q, kv = torch.arange(2)[:, None, None], torch.arange(6)[None, :, None], torch.arange(6)[None, None, :]
    assert torch.equal(same_document(doc)(b, 0, q, kv), m[:, 0])


def _packed(samples: list[list[torch.Tensor]]):
    """(x, y, doc) of windows holding the samples back to back; a sample's last target (the next one's first
    token) is IGNORE_INDEX, as the data builds it."""
    xs, ys, docs = [], [], []
    for row in samples:
        xs.append(torch.cat(row))
        ys.append(torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]) for s in row]))
        docs.append(torch.cat([torch.full((len(s),), i, dtype=torch.int32) for i, s in enumerate(row)]))
    return torch.stack(xs), torch.stack(ys), torch.stack(docs)


@pytest.mark.parametrize("arch", FAMILIES)
def test_packed_equals_alone(arch):
    torch.manual_seed(0)
    model = build_model(FAMILIES[arch].resolve()).eval()  # eval: the MoE's load-balancing loss is a batch statistic
    g = torch.Generator().manual_seed(1)
    samples = [[torch.randint(0, 97, (n,), generator=g) for n in row] for row in ROWS]
    x, y, doc = _packed(samples)

    # every per-token loss of the packed windows equals that token's loss with its sample run alone
    logits = model(x, doc=doc)  # (B, T, V)
    packed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    alone = []
    for row in samples:
        for s in row:
            out = model(s[None])[0]  # (n, V)
            alone.append(F.cross_entropy(out[:-1], s[1:], reduction="none"))
            alone.append(torch.zeros(1))  # the sample's last target: not counted
    alone = torch.cat(alone)
    torch.testing.assert_close(packed, alone.view_as(packed), rtol=1e-5, atol=1e-6)
    # and without the mask the packed windows are different: the test sees cross-talk when there is some
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    assert (plain - packed).abs().max() > 1e-3

    # the gradient of the summed loss equals the sum of the samples' gradients
    model.zero_grad()
    model(x, y, reduction="sum", doc=doc).backward()
    together = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for row in samples:
        for s in row:
            if len(s) > 1:
                model(s[None, :-1], s[None, 1:], reduction="sum").backward()
    for name, p in model.named_parameters():
        err = (together[name] - p.grad).norm()
        assert err <= 1e-5 * p.grad.norm() + 1e-12, f"{arch} {name}: |Δgrad| {err:.3g} vs |grad| {p.grad.norm():.3g}"


def test_doc_shape_and_cache_refused():
    model = build_model(FAMILIES["llama"].resolve())
    x = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"doc must have the token ids' shape \(2, 6\), got \(2, 5\)"):
        model(x, doc=torch.zeros(2, 5, dtype=torch.int32))
    from kiln.models.cache import KVCache
    with pytest.raises(ValueError, match="generation with the KV cache takes none"):
        model(x, doc=torch.zeros(2, 6, dtype=torch.int32), cache=KVCache(2, 32))


@pytest.mark.parametrize("plan", [("full", "seg"), ("selective", "none")])
def test_recompute_and_chunked_loss_pass_doc_through(plan):
    """Recompute hands the blocks' second argument (the Window with the mask) to the checkpoint, the chunked loss
    sees only hidden states and targets: the same loss and gradients as the plain model, doc and all."""
    from kiln.memory.chunked_loss import ChunkedLMLoss
    from kiln.memory.recompute import apply_recompute

    torch.manual_seed(0)
    cfg = FAMILIES["qwen3"].resolve()
    plain, levered = build_model(cfg), build_model(cfg)
    levered.load_state_dict(plain.state_dict())
    apply_recompute(levered, plan)
    levered.loss = ChunkedLMLoss(7)
    g = torch.Generator().manual_seed(2)
    x, y, doc = _packed([[torch.randint(0, 97, (n,), generator=g) for n in row] for row in ROWS])
    losses = [m(x, y, reduction="sum", doc=doc) for m in (plain, levered)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), levered.parameters()):
        err = (q.grad - p.grad).norm()
        assert err <= 1e-5 * p.grad.norm(), f"{name}: |Δgrad| {err:.3g} vs |grad| {p.grad.norm():.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flex_attention has no backward on a CPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_mask_equals_the_boolean_mask_on_cuda(dtype):
    """document_block_mask (flex_attention, for a GPU and context parallel) against document_mask (SDPA): the same
    attention forward and backward. On a CPU its forward alone was checked by hand: max |Δ| 4.8e-7 in fp32."""
    from kiln.models.documents import document_block_mask
    from kiln.models.parts import SDPA

    torch.manual_seed(0)
    doc = _packed([[torch.zeros(n, dtype=torch.long) for n in row] for row in ROWS])[2].cuda().repeat(1, 8)
    doc = doc + torch.arange(8, device="cuda").repeat_interleave(22)[None] * 10  # (3, 176): 8 copies of each row
    q = torch.randn(3, 4, 176, 32, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(3, 2, 176, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    core, grads = SDPA(), []
    for mask in (document_mask(doc), document_block_mask(doc, block_size=16)):
        out = core(q, k, v, mask)
        grads.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **tol)
