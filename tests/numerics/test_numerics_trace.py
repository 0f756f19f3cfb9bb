"""NaN/Inf origin tracing: planted faults are found where they were planted; natural ones where they arise."""
import json
import math

import pytest
import torch
import torch.nn as nn

from kiln.models import build_model
from kiln.numerics.trace import REPORT_FILE, NonFiniteTracer, replay_step
from kiln.train.objective import LanguageModeling
from kiln.train.step import micro_batch_losses
from kiln.train.precision import LossScaler, Precision, PrecisionConfig
from kiln.run.lm import train
from tests.conftest import small_model

CPU = torch.device("cpu")


def _events(run_dir, kind):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == kind]


def test_nan_in_forward_is_traced_to_its_module(small_config, tmp_path):
    # Log every 3 steps: the NaN at step 4 is found at the sync point of step 6, then replayed.
    cfg = small_config(model={"n_layer": 3}, train={"max_steps": 6}, log={"interval": 3},
                       faults={"nan_forward": "blocks.2.mlp@4"})
    summary = train(cfg, tmp_path / "run")
    report = json.loads((tmp_path / "run" / REPORT_FILE).read_text())
    assert (report["module"], report["phase"], report["step"]) == ("blocks.2.mlp", "forward", 4)
    assert report["op"].startswith("aten.") and report["stats"]["inputs_finite"] is True
    assert report["stats"]["outputs"][0]["nonfinite"] == 1  # the one planted NaN, caught before it spread
    assert report["module_stats"]["inputs"][0]["nonfinite"] == 0
    assert [e["step"] for e in _events(tmp_path / "run", "nonfinite")] == [4]
    assert summary.step == 6 and math.isfinite(summary.val_loss)  # the NaN step was never applied


def test_inf_in_backward_is_traced_to_its_module(small_config, tmp_path):
    cfg = small_config(train={"max_steps": 4}, log={"interval": 2}, faults={"inf_backward": "blocks.1.attn@3"})
    train(cfg, tmp_path / "run")
    report = json.loads((tmp_path / "run" / REPORT_FILE).read_text())
    assert (report["module"], report["phase"], report["step"]) == ("blocks.1.attn", "backward", 3)
    assert report["observed"]["grad_norm"] in ("inf", "nan")
    assert isinstance(report["observed"]["loss"], float)  # the forward was fine
    trace = _events(tmp_path / "run", "nonfinite_trace")
    assert [(t["module"], t["phase"]) for t in trace] == [("blocks.1.attn", "backward")]


def test_clean_run_writes_no_report(small_config, tmp_path):
    train(small_config(train={"max_steps": 4}), tmp_path / "run")
    assert not (tmp_path / "run" / REPORT_FILE).exists()
    assert not _events(tmp_path / "run", "nonfinite") and not _events(tmp_path / "run", "nonfinite_trace")


def _replay(model, x):
    precision, scaler = Precision("fp32", CPU), LossScaler(PrecisionConfig(), CPU, enabled=False)
    def losses(m, batches):
        return micro_batch_losses(m, batches, LanguageModeling(), precision)

    return replay_step(model, [(x, torch.roll(x, -1, 1))], losses, scaler)[0]


def test_natural_forward_overflow_is_found_at_the_op():
    """No fault hooks: a residual stream of ~1e30 overflows the next LayerNorm's variance (fp32 max 3.4e38)."""
    torch.manual_seed(0)
    model = build_model(small_model(n_layer=3, vocab_size=256))
    with torch.no_grad():
        model.blocks[1].mlp.proj.weight.mul_(1e30)
    finding = _replay(model, torch.randint(0, 256, (2, 16)))
    assert (finding["module"], finding["phase"]) == ("blocks.2.norm1", "forward")
    assert finding["op"] == "aten.native_layer_norm.default" and finding["stats"]["inputs_finite"]


def test_inf_weight_is_attributed_to_its_layer():
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=256))
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[3, 5] = float("inf")
    finding = _replay(model, torch.randint(0, 256, (2, 16)))
    assert (finding["module"], finding["phase"]) == ("blocks.1.attn.qkv", "forward")
    assert finding["stats"]["inputs_finite"] is False  # no op made it: the weight already was


class RootOfSquare(nn.Module):
    """sqrt(x²) = |x|: finite forward, but d/dx at x = 0 divides by sqrt(0) in the backward."""

    def forward(self, x):
        return torch.sqrt(x * x)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_natural_backward_nan_is_found_in_its_module():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), RootOfSquare(), nn.Linear(4, 1))
    with torch.no_grad():
        net[0].weight[0].zero_()
        net[0].bias.zero_()  # unit 0 is exactly 0 for every input
    x = torch.randn(8, 4)
    with NonFiniteTracer(net) as tracer:
        tracer.phase = "forward"
        out = net(x).sum()
        assert not tracer.found()
        tracer.phase = "backward"
        out.backward()
    finding = tracer.finding()
    assert (finding["module"], finding["phase"]) == ("1", "backward")
    assert finding["op"].startswith("aten.div") and finding["op_module"] == "1"
    # The tracer removed its hooks: a second backward runs without it and nothing is recorded anew.
    assert not net[1]._backward_hooks and not net[1]._forward_hooks


def test_a_nan_that_never_ends_stops_the_run(small_config, tmp_path):
    cfg = small_config(train={"max_steps": 30}, log={"interval": 5}, faults={"nan_forward": "blocks.0.mlp@3-30"},
                       numerics={"max_nonfinite_steps": 6})
    summary = train(cfg, tmp_path / "run")
    assert summary.step == 10  # steps 3-8 are six in a row; the sync point at 10 stops
    assert "6 non-finite steps in a row" in summary.stop_reason
    assert (tmp_path / "run" / "checkpoints" / "step_000010" / "state.pt").exists()
    report = json.loads((tmp_path / "run" / REPORT_FILE).read_text())
    assert (report["module"], report["step"]) == ("blocks.0.mlp", 3)  # one report: the first incident


def test_overflow_between_submodules_is_blamed_on_the_parent():
    """Token and position embeddings of 3e38 are each finite; their sum in Transformer.hidden overflows.

    The modules that then see Inf (dropout, the first block) have non-finite inputs, so they are not the origin.
    """
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=256))
    with torch.no_grad():
        model.embed.weight.fill_(3e38)
        model.pos_embed.weight.fill_(3e38)
    finding = _replay(model, torch.randint(0, 256, (2, 16)))
    assert (finding["module"], finding["phase"]) == ("(model)", "forward")
    assert finding["op"].startswith("aten.add") and finding["stats"]["inputs_finite"]


class OutsideKernel(nn.Module):
    """Writes its output the way a Triton kernel does: into torch.empty_like memory, outside the dispatcher (here
    through numpy), so no aten op ever computes it. Element 0 comes out Inf from finite inputs."""

    def forward(self, x):
        out = torch.empty_like(x)
        values = x.detach().numpy() * 2
        values.flat[0] = float("inf")
        out.numpy()[...] = values
        return out


def test_an_allocation_op_is_never_the_origin(monkeypatch):
    """Under deterministic algorithms torch fills empty tensors with NaN; the tracer used to name aten.empty_like
    as the origin. The origin is the kernel that filled the buffer, in the module that allocated it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), OutsideKernel(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory and torch.empty(2).isnan().all()
        with torch.no_grad(), NonFiniteTracer(net) as tracer:
            net(x)
    finally:
        torch.use_deterministic_algorithms(False)
    finding = tracer.finding()
    assert (finding["module"], finding["phase"]) == ("1", "forward")
    assert "empty" not in finding["op"].split(" that filled")[0]
    assert finding["op"] == "a kernel outside aten (Triton?) that filled the output of aten.empty_like.default"
    assert finding["op_module"] == "1" and finding["outside_dispatch"] is True


def test_a_non_finite_buffer_is_named(tmp_path):
    """The rotary cos/sin cache is a buffer, computed when the model is built (rope_theta=0 made it NaN): the report
    names it rather than the first op that read it."""
    from kiln.numerics.trace import describe, trace_nonfinite

    torch.manual_seed(0)
    model = build_model(small_model(arch="llama", n_kv_head=1, rope_theta=10000.0, vocab_size=256))
    with torch.no_grad():
        model.rope_cos[5:] = float("nan")
    precision, scaler = Precision("fp32", CPU), LossScaler(PrecisionConfig(), CPU, enabled=False)
    x = torch.randint(0, 256, (2, 16))
    report = trace_nonfinite(model, [(x, torch.roll(x, -1, 1))],
                             lambda m, b: micro_batch_losses(m, b, LanguageModeling(), precision), scaler, 1,
                             {"loss": math.nan, "grad_norm": math.nan}, tmp_path)
    assert report["nonfinite_buffers"] == ["rope_cos"] and report["nonfinite_parameters"] == []
    assert (report["buffer"], report["module"], report["phase"]) == ("rope_cos", "(model)", "before the step")
    assert describe(report).startswith("non-finite at step 1: buffer rope_cos held NaN/Inf before the step")
    assert "buffers already non-finite: rope_cos (computed before the step" in describe(report)
    assert json.loads((tmp_path / REPORT_FILE).read_text())["buffer"] == "rope_cos"
