"""The start line of optim.name=muon on a CPU without fast bf16: torch's Muon orthogonalises in bf16 whatever
precision.mode is, so there its Newton-Schulz products can cost more than the forward and backward. The line's
FLOPs are checked against torch's own FLOP counter around a real torch.optim.Muon step."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kiln.run.start as start


def _muon(ns_steps: int = 5):
    torch.manual_seed(0)
    hidden = [torch.nn.Parameter(torch.randn(*s)) for s in ((48, 16), (16, 48), (32, 32))]
    other = torch.nn.Parameter(torch.randn(16))
    for p in (*hidden, other):
        p.grad = torch.randn_like(p)
    groups = [{"params": hidden, "muon": True}, {"params": [other]}]
    return groups, torch.optim.Muon(hidden, ns_steps=ns_steps)


class _Groups:  # what the notice reads of kiln's MuonAdamW: its param_groups, the Muon ones marked
    def __init__(self, groups):
        self.param_groups = groups


@pytest.mark.parametrize("ns_steps", [5, 3])
def test_an_emulated_bf16_cpu_gets_the_muon_cost_in_seconds(monkeypatch, ns_steps):
    rates = {"bf16": 2e9, "fp32": 1e11}  # an AVX2-only CPU's order: emulated bf16 ~50x slower than fp32
    monkeypatch.setattr(start, "stored_cpu_peak", rates.__getitem__)
    monkeypatch.setattr(start, "native_bf16", lambda: None)
    groups, torch_muon = _muon(ns_steps)
    with FlopCounterMode(display=False) as counter:
        torch_muon.step()
    flops = counter.get_total_flops()
    line = start.muon_notice(_Groups(groups), torch.device("cpu"), ns_steps)
    assert line == (f"optim.name=muon: torch's Muon orthogonalises in bf16, emulated on this CPU (2 GFLOP/s vs fp32 "
                    f"100 GFLOP/s): its Newton-Schulz products, {flops / 1e9:.3g} GFLOP a step, take "
                    f"~{flops / 2e9:.3g} s of every step here; --optim.name=adamw does without them")


def test_no_line_where_bf16_is_native_and_fast_or_without_muon(monkeypatch):
    monkeypatch.setattr(start, "stored_cpu_peak", {"bf16": 1.2e12, "fp32": 1.5e11}.__getitem__)
    monkeypatch.setattr(start, "native_bf16", lambda: "AMX")
    groups, _ = _muon()
    assert start.muon_notice(_Groups(groups), torch.device("cpu"), 5) is None
    monkeypatch.setattr(start, "stored_cpu_peak", {"bf16": 5e10, "fp32": 1.5e11}.__getitem__)  # native, slower
    assert "slower than fp32 on this CPU" in start.muon_notice(_Groups(groups), torch.device("cpu"), 5)
    assert start.muon_notice(_Groups([{"params": groups[1]["params"]}]), torch.device("cpu"), 5) is None  # adamw
    assert start.muon_notice(_Groups(groups), torch.device("cuda"), 5) is None
