"""Packed documents (kiln.models.documents): a window of several samples computes, token for token, what each
sample computes alone, in every family; the loss's gradient is the sum of the samples' gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.models import build_model
from kiln.models.config import ModelConfig
from kiln.models.documents import document_mask, positions
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
