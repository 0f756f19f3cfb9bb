"""train.stop_at_val_loss stops at the first evaluation at or below the target; train.eval_batches=0 evaluates
every window of the val split once, in order."""
import json

import numpy as np
import pytest
import torch

from kiln.data.loader import val_batches
from kiln.run.lm import train
from kiln.train.loop import TrainConfig
from kiln.train.target import eval_batch_count


def _records(run_dir, kind):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def test_stops_at_the_first_evaluation_at_or_below_the_target(small_config, tmp_path):
    sections = dict(train={"max_steps": 6, "eval_interval": 2})
    full = train(small_config(**sections), tmp_path / "full")
    losses = {r["step"]: r["val_loss"] for r in _records(tmp_path / "full", "eval")}
    assert sorted(losses) == [2, 4, 6] and full.stop_reason == "max_steps"
    target = losses[4]  # the first evaluation at or below it, by the same-seed run's record
    first = min(s for s, v in losses.items() if v <= target)
    stopped = train(small_config(train={**sections["train"], "stop_at_val_loss": target}), tmp_path / "target")
    assert stopped.step == first and stopped.val_loss == losses[first]
    assert stopped.stop_reason == f"target: val_loss {losses[first]:.4f} ≤ {target:g} at step {first}"
    events = [r for r in _records(tmp_path / "target", "event") if r["event"] == "target_reached"]
    assert len(events) == 1 and events[0]["step"] == first and events[0]["val_loss"] == losses[first]
    assert events[0]["elapsed_s"] > 0
    assert [r["step"] for r in _records(tmp_path / "target", "eval")] == [s for s in sorted(losses) if s <= first]


@pytest.mark.parametrize("n_tokens,seq_len,batch", [(1000, 32, 4), (1025, 32, 4), (97, 8, 3), (33, 32, 8)])
def test_eval_batches_zero_covers_every_window_once_in_order(n_tokens, seq_len, batch):
    tokens = np.arange(n_tokens, dtype=np.uint16)
    tc = TrainConfig(micro_batch_size=batch, eval_batches=0)
    count = eval_batch_count(tc, n_tokens, seq_len)
    xs, ys = zip(*val_batches(tokens, batch, seq_len, count))
    x, y = torch.cat(xs), torch.cat(ys)
    windows = (n_tokens - 1) // seq_len
    assert x.shape == (windows, seq_len)
    assert torch.equal(x[:, 0], torch.arange(windows) * seq_len)  # window k starts at token k·seq_len, in order
    assert torch.equal(x.flatten(), torch.arange(windows * seq_len))  # each token read once, none skipped
    assert torch.equal(y.flatten(), torch.arange(1, windows * seq_len + 1))
    assert eval_batch_count(TrainConfig(eval_batches=5), n_tokens, seq_len) == 5


def test_speedrun_example_loads_as_the_reference_sets_the_data():
    from pathlib import Path

    from kiln.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(str(root / "examples" / "speedrun_cpu.toml"), ["--train.stop_at_val_loss=2.0"])
    assert (cfg.optim.name, cfg.train.eval_batches, cfg.train.stop_at_val_loss) == ("muon", 0, 2.0)
    assert (cfg.data.source, cfg.data.tokenizer, cfg.data.seq_len, cfg.model.preset) == ("stdlib", "bytes", 256, "tiny")
    # the bound: at most the tiny preset's parameters (QK-norm's gains are paid for by a narrower MLP)
    from dataclasses import replace

    from kiln.models import build_model
    tiny = build_model(replace(load_config(None, ["--model.preset=tiny"]).model, vocab_size=256, max_seq_len=256))
    mine = build_model(replace(cfg.model, vocab_size=256, max_seq_len=256))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(tiny) == 10_818_432 >= count(mine)
