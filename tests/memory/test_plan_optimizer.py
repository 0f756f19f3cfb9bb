"""The planner keeps the user's optimizer and recommends only what `kiln train` accepts with it (issue #40):
optim.name=muon refuses optim.offload (kiln.train.optim), ZeRO-1, FSDP2 and tp (kiln.parallel.strategy's table),
so `kiln plan` with muon offers neither the host optimizer nor those layouts, and never swaps muon for adamw."""
import itertools
import json

import pytest

from kiln.cli.main import main
from kiln.config import Config, ConfigError, apply_overrides, load_config
from kiln.memory import devices
from kiln.memory.devices import Device, get_device
from kiln.memory.levers import JobSections
from kiln.memory.planner import Choice, _valid, search
from kiln.parallel.layout import ParallelPlan, check_degrees
from kiln.parallel.strategy import STRATEGIES


def _plan(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _accepted(overrides: dict, preset: str, gpus: int) -> None:
    """The candidate's flags through the config's checks and the launch's degree checks (ConfigError /
    KilnError when kiln train would refuse them)."""
    flags = [f"--{k}={v}" for k, v in overrides.items() if v not in ("", None)]
    cfg = load_config(None, [f"--model.preset={preset}", *flags])
    check_degrees(cfg.parallel, gpus, cfg.model.resolve())


def _distinct(candidates) -> list[dict]:
    """The candidates' flags, once per combination of everything but the batch split and the recompute policy
    (which no refusal here reads; kiln.config checks them on their own)."""
    out = {}
    for c in candidates:
        o = c["overrides"] if isinstance(c, dict) else c.overrides
        out.setdefault(tuple(sorted((k, str(v)) for k, v in o.items()
                                    if not k.startswith(("train.", "memory.recompute")))), o)
    return list(out.values())


def test_muon_plan_on_one_gpu_keeps_muon_on_the_device(capsys):
    """Was: `error: optim.name='muon' has no optimizer-state size here` (the host optimizer offered with muon)."""
    out = _plan(capsys, "--device=H100", "--memory=20GiB", "--optim.name=muon", "--model.preset=gpt2-1.5b")
    assert out["candidates"] and out["best"]["fits"]
    for c in out["candidates"]:
        o = c["overrides"]
        assert (o["optim.name"], o["optim.offload"]) == ("muon", "none"), o
        assert c["host"].get("optimizer_states", 0) == 0
    for o in _distinct(out["candidates"]):
        _accepted(o, "gpt2-1.5b", 1)
    # the same overrides with the offload the planner left out: refused by kiln train, in one line
    with pytest.raises(ConfigError, match="--optim.offload=none with muon"):
        _accepted(out["best"]["overrides"] | {"optim.offload": "host"}, "gpt2-1.5b", 1)


# `--device=cpu` is this machine's CPU, measured once per process (~2 s); a fixed one keeps the test fast and its
# plan the same on every machine: the shared 2-core Xeon's rates as cpu_device measured them (fp32 ~100 GFLOP/s,
# bf16 with AMX ~1.2 TFLOP/s, copies ~10 GB/s), 24 GiB.
CPU = Device(name="cpu", memory=24 * 2**30, peak_flops={"fp32": 1e11, "bf16": 1.2e12, "fp16": 1.3e11}, bandwidth=1e10,
             host_link=1e10, host_bandwidth=1e10, context_bytes=400 * 2**20, fragmentation=0.0, kind="cpu")


def test_muon_plan_on_two_ranks_recommends_ddp_layouts_only(capsys, monkeypatch):
    """Was: the tp / pp / cp layouts' candidates took adamw, and the plan recommended `--optim.name=adamw
    --parallel.tp=2`. Now every candidate is muon, none shards the optimizer state or splits matrices (tp), and each
    passes kiln's config and launch checks for 2 ranks."""
    monkeypatch.setitem(devices._cpu_cache, "cpu", CPU)
    out = _plan(capsys, "--device=cpu", "--gpus=2", "--optim.name=muon", "--model.preset=tiny")
    layouts = set()
    for c in out["candidates"]:
        o = c["overrides"]
        assert o["optim.name"] == "muon" and o.get("parallel.tp", 1) == 1, o
        layouts.add((o["parallel.strategy"], o.get("parallel.pp", 1), o.get("parallel.cp", 1)))
    # data parallel under ddp, and the pipeline and context-parallel layouts with ddp over their copies (or none)
    assert {("ddp", 1, 1), ("none", 2, 1)} <= layouts, layouts
    assert {s for s, _, _ in layouts} <= {"ddp", "none"}, layouts
    for o in _distinct(out["candidates"]):
        _accepted(o, "tiny", 2)


def test_search_keeps_the_users_optimizer():
    """Every candidate, the tensor- and pipeline-parallel layouts' included (they took adamw before), carries
    optim.name as given; only adamw is also offered its 8-bit form (the same decoupled update on 8-bit moments,
    named in the optimizer column and the flags), not adam (AdamW8bit would decouple adam's L2 decay). A global
    batch of 2 sequences keeps the search small: micro-batches 1 and 2 over 2 ranks."""
    for optimizer, offered in [("adamw8bit", {"adamw8bit"}), ("adam", {"adam"}), ("adamw", {"adamw", "adamw8bit"})]:
        cfg = load_config(None, ["--model.preset=tiny", f"--optim.name={optimizer}"])
        plan = search(JobSections.of(cfg), get_device("H100"), 40 * 2**30, 2 * 256, gpus=2, context=False,
                      expert=False)
        assert {c.choice.tp for c in plan.candidates} == {1, 2}, optimizer
        assert {c.choice.optimizer for c in plan.candidates} == offered
        for overrides in _distinct(plan.candidates):
            _accepted(overrides, "tiny", 2)


def test_planner_refuses_what_config_refuses_with_muon():
    """_valid (what the search keeps) and kiln.config agree on every strategy × tp × optimizer offload × optimizer
    with muon beside adamw: one table (kiln.parallel.strategy) and the optimizer's own check, asked by both."""
    kept = 0
    for name, tp, offload, optimizer in itertools.product(STRATEGIES, (1, 2), ("none", "host"), ("adamw", "muon")):
        plan = ParallelPlan(2 * tp, tp, 1, name, tp > 1)
        choice = Choice("bf16", 1, 1, optimizer=optimizer, optim_offload=offload, plan=plan)
        cfg = Config()
        try:
            apply_overrides(cfg, {"parallel.strategy": name, "parallel.tp": tp, "optim.offload": offload,
                                  "precision.mode": "bf16", "optim.name": optimizer})
            accepted = True
        except ConfigError:
            accepted = False
        assert _valid(choice, cfg.optim) == accepted, (name, tp, offload, optimizer)
        kept += accepted
    # muon: ddp and none, tp 1, no offload (2 of 16); adamw: all but fsdp with offload (12 of 16)
    assert kept == 14
