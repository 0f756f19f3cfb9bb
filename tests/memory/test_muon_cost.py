"""Muon's optimizer cost in the planner (issue #40): kiln.memory.muon_cost's Newton-Schulz FLOPs against
torch.utils.flop_counter.FlopCounterMode around a real step of kiln's optimizer (torch.optim.Muon on kiln's split,
AdamW on the rest) for small models of each family, and against torch's Muon on odd single matrices; the planner's
Muon prediction exceeds AdamW's by exactly that part (undivided under DDP, a pipeline stage's own matrices); `kiln
plan --optim.name=muon` prints the optimizer's share."""
import json
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.cli.main import main
from kiln.config import load_config
from kiln.memory import devices
from kiln.memory.devices import Device, get_device
from kiln.memory.estimate import local_parameter_shapes, parameter_shapes
from kiln.memory.levers import JobSections, job_for, rank_jobs
from kiln.memory.muon_cost import NS_STEPS, muon_cost, newton_schulz_flops
from kiln.memory.planner import step_time, time_constants
from kiln.run.lm import build_lm
from tests.parallel.conftest import one_thread

# the shared 2-core Xeon's rates as cpu_device measured them (tests/memory/test_plan_optimizer.py): fixed, so the
# plan is the same on every machine
CPU = Device(name="cpu", memory=24 * 2**30, peak_flops={"fp32": 1e11, "bf16": 1.2e12, "fp16": 1.3e11}, bandwidth=1e10,
             host_link=1e10, host_bandwidth=1e10, context_bytes=400 * 2**20, fragmentation=0.0, kind="cpu")


def _counted(step) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


@pytest.mark.parametrize("m,n", [(5, 3), (3, 7), (4, 4), (48, 16)])
def test_newton_schulz_flops_equal_torch_muons_on_one_matrix(m, n):
    """Tall, wide and square: torch transposes a tall update so the Gram matrix is min(m, n) square."""
    p = torch.nn.Parameter(torch.randn(m, n))
    p.grad = torch.randn(m, n)
    opt = torch.optim.Muon([p])
    assert opt.defaults["ns_steps"] == NS_STEPS  # kiln.train.muon builds torch's Muon with its default
    assert _counted(opt.step) == newton_schulz_flops(m, n) > 0


@pytest.mark.parametrize("flags", [
    ["--model.tie_embeddings=false"],  # gpt2: qkv 3d × d, fc 4d × d, proj d × 4d and d × d; the untied head AdamW's
    ["--model.arch=llama", "--model.n_kv_head=2"],  # GQA's qkv (d + 2·kv) × d, SwiGLU's fused gate/up 2F × d
    ["--model.preset=qwen3-moe-nano"],  # the router and the stacked (E, out, in) experts are AdamW's
    ["--optim.muon_ns_steps=3"],  # fewer Newton-Schulz iterations: torch's Muon runs 3, the count follows
], ids=["gpt2", "llama", "qwen3-moe", "ns3"])
def test_muon_cost_equals_flop_counter_around_kilns_optimizer_step(flags):
    """The reference: FlopCounterMode around one step of the optimizer `kiln train` builds (torch.optim.Muon on
    kiln.train.muon's split, fused AdamW on the rest: no matmuls); the count: muon_cost on the estimator's
    parameter shapes (names and shapes, no model built)."""
    cfg = load_config(None, ["--model.preset=nano", "--model.n_layer=2", "--model.d_model=64", "--model.n_head=4",
                             "--data.seq_len=32", "--train.device=cpu", "--precision.mode=fp32",
                             "--optim.name=muon", *flags])
    with one_thread():
        rig = build_lm(cfg, device=torch.device("cpu"), with_data=False).state
        torch.manual_seed(0)
        for p in rig.model.parameters():
            p.grad = torch.randn_like(p)
        counted = _counted(rig.optimizer.step)
    hidden = [p for g in rig.optimizer.param_groups if g.get("muon") for p in g["params"]]
    steps = cfg.optim.muon_ns_steps
    cost = muon_cost(parameter_shapes(rig.model.cfg), steps)
    assert (cost.matrices, cost.params) == (len(hidden), sum(p.numel() for p in hidden))
    assert cost.flops == counted == sum(newton_schulz_flops(*p.shape, steps) for p in hidden)
    assert all(g["ns_steps"] == steps for g in rig.optimizer.param_groups if g.get("muon"))
    assert steps == (3 if "--optim.muon_ns_steps=3" in flags else NS_STEPS)


def _jobs(device, *flags, world: int = 1):
    out = []
    for optimizer in ("adamw", "muon"):
        cfg = load_config(None, ["--model.preset=tiny", "--data.seq_len=256", "--train.micro_batch_size=8",
                                 "--precision.mode=bf16", f"--optim.name={optimizer}", *flags])
        out.append(job_for(JobSections.of(cfg), device, world=world))
    return out


@pytest.mark.parametrize("device", [get_device("H100"), CPU], ids=["H100", "cpu"])
def test_planner_muon_exceeds_adamw_by_exactly_the_muon_part(device):
    """step_time(muon) − step_time(adamw) = Muon's part − the AdamW pass it replaces on the Muon matrices (28 bytes
    each); every other part the same. Under DDP every rank pays the whole Muon part (it is not divided by dp)."""
    me, be, op_s, _ = time_constants(device)
    single = None
    for world, flags in [(1, ()), (2, ("--parallel.strategy=ddp",))]:
        adamw, muon = _jobs(device, *flags, world=world)
        ta, tm = step_time(adamw, device), step_time(muon, device)
        cost = muon_cost(local_parameter_shapes(muon))
        part = cost.seconds(device.flops("bf16"), device.bandwidth, me, be, op_s)
        assert cost.flops == 95_126_814_720  # tiny: 6 × 5 × (2·(4·384²·1152 + 2·384³) ... ), by hand in the docstring
        assert tm["muon"] == part and "muon" not in ta
        replaced = 28 * cost.params / (device.bandwidth * be)
        for key in ("optimizer", "total"):
            assert tm[key] - ta[key] == pytest.approx(part - replaced, rel=1e-9, abs=1e-15), (world, key)
        assert {k: v for k, v in tm.items() if k not in ("optimizer", "total", "muon")} == \
            {k: v for k, v in ta.items() if k not in ("optimizer", "total")}
        single = single or part
        assert part == single  # world 2 under DDP: the same whole Muon part as one process
    assert part > replaced  # the products cost more than the elementwise pass they stand beside


def test_pipeline_stages_orthogonalise_their_own_matrices():
    cfg = load_config(None, ["--model.preset=tiny", "--optim.name=muon", "--parallel.pp=2"])
    sections = JobSections.of(cfg)
    _, stages = rank_jobs(sections, CPU, 2)
    costs = [muon_cost(local_parameter_shapes(j)) for j in stages]
    whole = muon_cost(parameter_shapes(sections.resolved_model()))
    assert [c.matrices for c in costs] == [12, 12] and sum(c.flops for c in costs) == whole.flops
    assert step_time(stages[0], CPU)["muon"] == pytest.approx(
        costs[0].seconds(CPU.flops("bf16"), CPU.bandwidth, *time_constants(CPU)[:3]), rel=1e-12)


def test_kiln_plan_prints_the_optimizers_share_with_muon(capsys, monkeypatch):
    monkeypatch.setitem(devices._cpu_cache, "cpu", CPU)
    argv = ["plan", "--device=cpu", "--model.preset=tiny", "--data.seq_len=256", "--train.micro_batch_size=8",
            "--top=1"]
    assert main([*argv, "--optim.name=muon", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]["time"]
    assert main([*argv, "--optim.name=muon"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("optimizer (recommended)")]
    assert lines == [f"optimizer (recommended): {best['optimizer']:.4g} s of the {best['total']:.4g} s step "
                     f"({best['optimizer'] / best['total']:.0%}); of it Muon {best['muon']:.4g} s: the model's 24 "
                     f"hidden matrices, 95.13 GFLOP of bf16 Newton-Schulz a step on every data-parallel rank "
                     f"(kiln.memory.muon_cost); AdamW the rest"]
    assert main(argv) == 0  # adamw: no such line
    assert "optimizer (recommended)" not in capsys.readouterr().out
