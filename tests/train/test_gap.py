"""The generalisation gap: each evaluation logs val − train loss, and kiln warns once when it keeps growing while
the training loss falls."""
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from kiln.run.lm import train
from kiln.train.loop import Trainer


def test_every_evaluation_logs_the_gap_to_the_train_losses_since_the_last(small_config, tmp_path):
    train(small_config(train={"max_steps": 9, "eval_interval": 3}, log={"interval": 1}), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6, 9]
    for e in evals:
        window = [r["loss"] for r in records if r["kind"] == "train" and e["step"] - 3 < r["step"] <= e["step"]]
        assert e["train_loss"] == pytest.approx(sum(window) / 3, rel=1e-12)
        assert e["gap"] == pytest.approx(e["val_loss"] - e["train_loss"], rel=1e-12)


class _Log(list):
    def log(self, record, kind):
        self.append((kind, record))


def _watcher(patience):
    console = Console(record=True, width=300)
    return SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(gap_patience=patience)), _gaps=[],
                           _gap_warned=False, con=console, logger=_Log(), state=SimpleNamespace(step=0))


@pytest.mark.parametrize("curve, warned", [
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 2.05), (1.4, 2.1)], True),  # train falls, val rises: the gap grows 3 times
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 2.05), (1.6, 2.1)], False),  # the gap grows but train stopped falling
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 1.7), (1.4, 2.1)], False),  # the gap shrank once: not 3 in a row
    ([(2.0, 2.0), (1.8, 2.0), (1.6, 2.05)], False),  # only 2 growths so far
])
def test_the_overfitting_warning_fires_once_on_k_growths_in_a_row(curve, warned):
    w = _watcher(3)
    for step, (train_loss, val_loss) in enumerate(curve + ([(1.2, 2.2), (1.0, 2.3)] if warned else []), 1):
        w.state.step = step
        Trainer._watch_gap(w, {"train_loss": train_loss, "val_loss": val_loss, "gap": val_loss - train_loss})
    events = [r for kind, r in w.logger if kind == "numerics"]
    assert len(events) == (1 if warned else 0)
    if warned:
        assert events[0]["step"] == 4 and "train.early_stop_patience" in events[0]["message"]
        assert "overfitting: the gap val − train grew 0.000 → 0.700 over 3 evaluations" in w.con.export_text()


def test_gap_patience_zero_never_warns():
    w = _watcher(0)
    for step, (t, v) in enumerate([(2.0, 2.0), (1.5, 2.5), (1.0, 3.0), (0.5, 3.5), (0.1, 4.0)], 1):
        Trainer._watch_gap(w, {"train_loss": t, "val_loss": v, "gap": v - t})
    assert w.logger == []
