"""train.eval_micro_batch_size regroups the evaluation's windows (same windows, same order) and one autocast region
casts each weight once per evaluation: the loss equals the evaluation of batches of train.micro_batch_size with one
autocast region per batch (fp32 within 1e-6 relative, bf16 within 1e-5), every window counted once."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.data.loader import val_batches
from kiln.run.lm import build_lm
from kiln.train.loop import TrainConfig
from kiln.train.step import evaluate
from kiln.train.target import eval_batch_count, eval_micro_batch, regroup

BF16_RTOL = 1e-5  # measured on a 2-core AMX Xeon: at most 3e-8 over these sizes; the tiny preset's full split 2.5e-8


@pytest.mark.parametrize("size", [1, 3, 4, 7, 16, 1000])
@pytest.mark.parametrize("with_doc", [False, True])
def test_regroup_keeps_every_window_once_in_order(size, with_doc):
    tokens = np.arange(1025, dtype=np.uint16)
    batches = list(val_batches(tokens, 4, 32, eval_batch_count(TrainConfig(micro_batch_size=4, eval_batches=0),
                                                              len(tokens), 32)))
    if with_doc:  # (x, y, doc) as packed documents give them: every tensor regrouped alike
        batches = [(x, y, x % 5) for x, y in batches]
    grouped = list(regroup(iter(batches), size))
    assert all(len(b[0]) == size for b in grouped[:-1]) and 1 <= len(grouped[-1][0]) <= size
    for k in range(len(batches[0])):
        assert torch.equal(torch.cat([b[k] for b in grouped]), torch.cat([b[k] for b in batches]))
    assert torch.equal(torch.cat([b[0] for b in grouped])[:, 0], torch.arange(32) * 32)  # 32 windows, in order


def test_auto_size_grows_on_a_cpu_only_within_its_token_and_logits_bounds():
    tc = TrainConfig(micro_batch_size=8)
    assert eval_micro_batch(tc, 256, 256, "cpu") == 32  # 8,192 tokens; logits 32 × 256 KiB ≪ 64 MiB
    assert eval_micro_batch(tc, 256, 256, "cuda") == 8  # not measured off a CPU: the training micro-batch
    assert eval_micro_batch(tc, 256, 256, "cpu", pipelined=True) == 8  # a pipeline splits its batches itself
    assert eval_micro_batch(tc, 256, 50304, "cpu") == 16  # GPT-2's vocabulary: at most twice the training logits
    assert eval_micro_batch(tc, 1024, 151936, "cpu") == 8  # never below the training micro-batch
    assert eval_micro_batch(TrainConfig(micro_batch_size=64), 256, 256, "cpu") == 64
    assert eval_micro_batch(TrainConfig(micro_batch_size=8, eval_micro_batch_size=5), 256, 256, "cuda") == 5


@torch.no_grad()
def _per_batch_of(lm, batches) -> tuple[float, int]:
    """The evaluation before eval_micro_batch_size: one autocast region per batch."""
    state = lm.state
    model = state.model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for batch in batches:
        with state.precision.autocast():
            total += state.objective(model, batch).double()
        count += int(state.objective.count(batch))
    return (total / count).item(), count


def _per_batch(lm) -> tuple[float, int]:
    """... over batches of train.micro_batch_size windows."""
    c = lm.cfg
    return _per_batch_of(lm, val_batches(lm.data.val, c.train.micro_batch_size, c.data.seq_len,
                                         eval_batch_count(c.train, len(lm.data.val), c.data.seq_len)))


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_regrouped_evaluation_equals_the_per_batch_one(small_config, tmp_path, mode):
    lm = build_lm(small_config(train={"eval_batches": 0}, precision={"mode": mode}), tmp_path, log=lambda m: None)
    c = lm.cfg
    before, tokens = _per_batch(lm)
    windows = (len(lm.data.val) - 1) // c.data.seq_len
    assert tokens == windows * c.data.seq_len  # every window of the split, each once
    assert eval_micro_batch(c.train, c.data.seq_len, c.model.padded_vocab, "cpu") > c.train.micro_batch_size
    for size in (0, 3):  # auto (256 windows of 32 tokens here: larger than micro_batch_size), smaller
        c.train.eval_micro_batch_size = size
        after = lm.evaluate(lm.state.model)
        assert after == pytest.approx(before, rel=1e-6 if mode == "fp32" else BF16_RTOL, abs=0)


class _WeightCasts(TorchDispatchMode):
    """Counts casts of fp32 tensors to bf16 whose shape is a weight matrix's."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.casts = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if func is torch.ops.aten._to_copy.default and src.dtype == torch.float32 and \
                kwargs.get("dtype") == torch.bfloat16 and tuple(src.shape) in self.shapes:
            self.casts += 1
        return func(*args, **kwargs)


def test_one_autocast_region_casts_each_weight_once_with_the_same_losses(small_config, tmp_path):
    lm = build_lm(small_config(precision={"mode": "bf16"}), tmp_path, log=lambda m: None)
    c, state = lm.cfg, lm.state
    batches = list(val_batches(lm.data.val, c.train.micro_batch_size, c.data.seq_len, 4))
    weights = {id(w): w for w in [m.weight for m in state.model.modules() if isinstance(m, torch.nn.Linear)]
               + [state.model.head_weight]}  # the blocks' linears and the head (tied: the embedding)
    shapes = {tuple(w.shape) for w in weights.values()}
    matrices = len(weights)
    with _WeightCasts(shapes) as once:
        loss = evaluate(state.model, batches, state.objective, state.precision, state.device)
    reference, _ = _per_batch_of(lm, batches)
    assert loss == reference  # the same casts of the same weights: bit for bit
    assert once.casts == matrices  # each weight matrix once, not once per batch (4 batches)
    with _WeightCasts(shapes) as per_batch:
        _per_batch_of(lm, batches)
    assert per_batch.casts == 4 * matrices

