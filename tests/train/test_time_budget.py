"""train.max_steps=0: the run is sized by train.time_budget from its measured step time, and the printed
max_steps repeats it exactly."""
import io
import re
import tomllib

import pytest
import torch
from rich.console import Console

from kiln.config import ConfigError, load_config
from kiln.run.lm import train
from kiln.train.budget import CALIBRATION_MAX, CALIBRATION_STEPS


def _train(cfg, run_dir):
    out = io.StringIO()
    summary = train(cfg, run_dir, console=Console(file=out, width=200))
    return summary, out.getvalue()


def test_budgeted_run_is_sized_printed_saved_and_repeatable(small_config, tmp_path):
    sections = dict(train={"max_steps": 0, "time_budget": 1.5}, schedule={"warmup_steps": CALIBRATION_STEPS})
    budgeted, text = _train(small_config(**sections), tmp_path / "budgeted")
    match = re.search(r"max_steps ([\d,]+): train.time_budget 1.5 s at ([\d.]+) s/step", text)
    assert match, text
    assert f"(steps 3-{CALIBRATION_STEPS} on this cpu)" in text  # warm-up 10: measured over steps 3-10
    steps, step_time = int(match.group(1).replace(",", "")), float(match.group(2))
    assert budgeted.step == steps >= CALIBRATION_STEPS
    # The step count fills the budget at the measured rate (the floor is the calibration itself).
    # (the first two steps run slower than the measured ones, so the count may fall a few steps short)
    # (the printed step time is rounded to the millisecond)
    slow, fast = step_time + 5e-4, max(step_time - 5e-4, 1e-4)
    assert steps == CALIBRATION_STEPS or 1.5 / slow - CALIBRATION_STEPS <= steps <= 1.5 / fast + 1
    for path in (tmp_path / "budgeted" / "config.toml", tmp_path / "budgeted" / "checkpoints" /
                 f"step_{steps:06d}" / "config.toml"):
        assert tomllib.loads(path.read_text())["train"]["max_steps"] == steps

    fixed, _ = _train(small_config(train={"max_steps": steps}, schedule={"warmup_steps": CALIBRATION_STEPS}),
                      tmp_path / "fixed")
    a, b = budgeted.state.model.state_dict(), fixed.state.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert budgeted.val_loss == fixed.val_loss


def test_budget_never_cuts_the_warmup_short(small_config, tmp_path):
    # A budget smaller than the calibration itself still runs the warm-up the schedule was written for.
    summary, _ = _train(small_config(train={"max_steps": 0, "time_budget": 1e-3},
                                     schedule={"warmup_steps": 12}), tmp_path / "run")
    assert summary.step == 12


def test_budgeted_run_with_a_short_warmup_is_refused_with_the_fix(small_config, tmp_path):
    cfg = small_config(train={"max_steps": 0}, schedule={"warmup_steps": 2})
    with pytest.raises(ValueError, match=r"needs schedule.warmup_steps ≥ 10 \(got 2\); raise it, or set "
                                         r"train.max_steps"):
        train(cfg, tmp_path / "run", console=Console(file=io.StringIO()))
    # A constant schedule, or an explicit horizon, does not depend on the run's length.
    summary, _ = _train(small_config(train={"max_steps": 0, "time_budget": 1e-3},
                                     schedule={"warmup_steps": 2, "name": "constant"}), tmp_path / "constant")
    assert summary.step == CALIBRATION_MAX  # measured over more steps when the schedule allows


def test_max_steps_and_budget_both_zero_is_a_config_error():
    with pytest.raises(ConfigError, match="set --train.max_steps=N or --train.time_budget=SECONDS"):
        load_config(None, ["--train.max_steps=0", "--train.time_budget=0"])
