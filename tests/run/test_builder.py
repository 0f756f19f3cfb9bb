"""The one run builder (kiln.run.builder): `kiln train` and `kiln.fit` build their runs through it, the layout is
built once per run, and no step changes the caller's Config; what the run decides is in its config.toml."""
import copy
import io
import tomllib

import torch
import torch.nn as nn
from rich.console import Console

import kiln.run.builder as builder
from kiln.parallel.layout import ParallelPlan
from kiln.run.fit import fit, fit_config
from kiln.run.lm import train
from kiln.train.budget import CALIBRATION_STEPS


def _count_plans(monkeypatch) -> list:
    """Every ParallelPlan.build call of the run, recorded."""
    built, original = [], ParallelPlan.build.__func__

    def build(cls, *args, **kw):
        built.append(original(cls, *args, **kw))
        return built[-1]

    monkeypatch.setattr(ParallelPlan, "build", classmethod(build))
    return built


def test_a_budgeted_train_run_leaves_its_config_alone_and_records_what_it_decided(small_config, tmp_path,
                                                                                   monkeypatch):
    built = _count_plans(monkeypatch)
    cfg = small_config(train={"max_steps": 0, "time_budget": 1.0, "compile": False, "cpu_linear": "auto"},
                       precision={"mode": "auto"}, schedule={"warmup_steps": CALIBRATION_STEPS})
    before = copy.deepcopy(cfg)
    result = train(cfg, tmp_path / "run", console=Console(file=io.StringIO()))
    assert cfg == before  # nothing the run decided was written into the caller's Config
    assert len(built) == 1 and built[0] is result.state.world.plan  # the layout, once, and the one the run asks
    recorded = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    # every decision, recorded: the budget's step count, compile, cpu_linear and precision with their reasons
    assert recorded["train"]["max_steps"] == result.step == result.cfg.train.max_steps >= CALIBRATION_STEPS
    assert recorded["train"]["cpu_linear_decided_by"]
    assert recorded["train"]["cpu_linear"] in ("onednn", "torch")
    assert recorded["train"]["cpu_allocator_decided_by"].startswith("auto: ")  # tuned, or system and why
    assert recorded["precision"]["mode"] != "auto" and recorded["precision"]["decided_by"]
    assert (cfg.train.max_steps, cfg.precision.mode, cfg.train.compile_decided_by) == (0, "auto", "")


def _spy(fn, calls):
    def wrapped(*args, **kw):
        calls.append(fn.__name__)
        return fn(*args, **kw)
    return wrapped


def test_fit_builds_through_the_same_builder_once_and_leaves_its_config_alone(tmp_path, monkeypatch):
    built = _count_plans(monkeypatch)
    runs = []
    monkeypatch.setattr("kiln.run.fit.build_run", _spy(builder.build_run, runs))
    cfg = fit_config({"train.max_steps": 3, "train.device": "cpu", "log.progress": "off", "log.tensorboard": False})
    before = copy.deepcopy(cfg)
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]
    result = fit(nn.Linear(8, 1), data, loss="mse", config=cfg, run_dir=tmp_path / "fit",
                 console=Console(file=io.StringIO()))
    assert cfg == before
    assert runs == ["build_run"] and len(built) == 1 and built[0] is result.state.world.plan
    recorded = tomllib.loads((tmp_path / "fit" / "config.toml").read_text())
    assert recorded["train"]["cpu_linear"] in ("onednn", "torch") and recorded["optim"]["lr"] == 1e-3
    assert cfg.train.cpu_linear == "auto" and cfg.optim.lr != 1e-3  # fit()'s default, recorded, not written back
    assert recorded["train"]["cpu_allocator_decided_by"].startswith("auto: ") and not cfg.train.cpu_allocator_decided_by
