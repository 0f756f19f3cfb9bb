"""The generalisation gap: each evaluation logs val − train loss, and kiln warns once when it keeps growing while
the training loss falls."""
import json
from types import SimpleNamespace

import pytest

from kiln.run.lm import train
from kiln.train.gap import GapMonitor


def test_every_evaluation_logs_the_gap_to_the_train_losses_since_the_last(small_config, tmp_path):
    train(small_config(train={"max_steps": 9, "eval_interval": 3, "gap_patience": 1}, log={"interval": 1}),
          tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6, 9]
    for e in evals:
        window = [r["loss"] for r in records if r["kind"] == "train" and e["step"] - 3 < r["step"] <= e["step"]]
        assert e["train_loss"] == pytest.approx(sum(window) / 3, rel=1e-12)
        assert e["gap"] == pytest.approx(e["val_loss"] - e["train_loss"], rel=1e-12)
    # gap_patience=1: the warning is logged, once, at the first evaluation whose gap grew while train loss fell
    grew = [b["step"] for a, b in zip(evals, evals[1:]) if b["gap"] > a["gap"] and b["train_loss"] < a["train_loss"]]
    warned = [r for r in records if r["kind"] == "numerics" and r.get("event") == "overfitting"]
    assert grew and [r["step"] for r in warned] == grew[:1]  # this run's gap grows at step 6 (3 → 6)
    first = next(e for e in evals if e["step"] == grew[0])
    assert warned[0]["gap"] == first["gap"] and "grew" in warned[0]["message"] and "over 1 evaluations" in \
        warned[0]["message"]


def _watcher(patience):
    return GapMonitor(SimpleNamespace(gap_patience=patience, early_stop_patience=0, early_stop_min_delta=0.0))


@pytest.mark.parametrize("curve, warned", [
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 2.05), (1.4, 2.1)], True),  # train falls, val rises: the gap grows 3 times
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 2.05), (1.6, 2.1)], False),  # the gap grows but train stopped falling
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 1.7), (1.4, 2.1)], False),  # the gap shrank once: not 3 in a row
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 2.05)], False),  # only 2 growths so far
])
def test_the_overfitting_warning_fires_once_on_k_growths_in_a_row(curve, warned):
    w = _watcher(3)
    warnings = {}
    for step, (train_loss, val_loss) in enumerate(curve + ([(1.2, 2.2), (1.0, 2.3)] if warned else []), 1):
        w.observe(train_loss)
        message = w.compare({"val_loss": val_loss})
        if message is not None:
            warnings[step] = message
    assert list(warnings) == ([4] if warned else [])
    if warned:
        assert "train.early_stop_patience" in warnings[4]
        assert "overfitting: the gap val − train grew 0.000 → 0.700 over 3 evaluations" in warnings[4]


def test_gap_patience_zero_never_warns():
    w = _watcher(0)
    for t, v in [(2.0, 2.0), (1.5, 2.5), (1.0, 3.0), (0.5, 3.5), (0.1, 4.0)]:
        w.observe(t)
        assert w.compare({"val_loss": v}) is None

