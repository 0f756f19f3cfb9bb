"""fp16 telemetry: the loss-scale history shows back-off and recovery; underflowing tensors are named."""
import json

from kiln.numerics.trace import REPORT_FILE
from kiln.run.lm import train


def _events(run_dir, kind):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == kind]


def _fp16(small_config, fault, steps=24, **numerics):
    # Scale 2^-10: almost every fp16 gradient element underflows; growth every 2 clean steps brings it back up.
    return small_config(precision={"mode": "fp16", "init_scale": 2.0**-10, "growth_interval": 2},
                        faults={"inf_backward": fault}, train={"max_steps": steps}, log={"interval": 4},
                        numerics={"fp16_telemetry_interval": 10, **numerics})


_planted: dict = {}  # the run with one planted overflow at step 12, shared by the two tests below


def _planted_run(small_config, tmp_path_factory):
    if not _planted:
        run_dir = tmp_path_factory.mktemp("fp16") / "run"
        _planted.update(result=train(_fp16(small_config, "blocks.1.attn@12"), run_dir), dir=run_dir)
    return _planted


def test_scale_backs_off_at_the_overflow_and_recovers(small_config, tmp_path_factory):
    planted = _planted_run(small_config, tmp_path_factory)
    summary, run_dir = planted["result"], planted["dir"]
    changes = [(e["step"], e["cause"], e["loss_scale"]) for e in _events(run_dir, "loss_scale")]
    assert [c for c in changes if c[1] == "overflow"] == [(12, "overflow", 2.0**-6)]  # halved from 2^-5
    before = max(s for step, _, s in changes if step < 12)
    after = max(s for step, _, s in changes if step > 12)
    assert before == 2.0**-5 and after > before  # grew back past where it was
    assert summary.state.scaler.scale.item() == after
    # A gradient overflow under loss scaling is the scaler's job: no NaN report, no non-finite events.
    assert not (run_dir / REPORT_FILE).exists() and not _events(run_dir, "nonfinite")


def test_telemetry_names_the_underflowing_tensors(small_config, tmp_path_factory):
    grads = {e["step"]: e for e in _events(_planted_run(small_config, tmp_path_factory)["dir"], "fp16_grads")}
    assert sorted(grads) == [1, 10, 20]
    first = grads[1]
    assert first["loss_scale"] == 2.0**-10
    assert {"blocks.0.mlp.fc.weight", "blocks.1.attn.qkv.weight"} <= set(first["underflow"])
    assert first["tensors"]["blocks.0.mlp.fc.weight"]["subnormal"] > 0
    # More scale, less underflow: the measurement follows the scale.
    assert grads[1]["mean_underflow"] > grads[10]["mean_underflow"] > grads[20]["mean_underflow"]
    assert len(grads[20]["underflow"]) < len(grads[1]["underflow"])


def test_collapsing_scale_gets_advice(small_config, tmp_path):
    train(_fp16(small_config, "blocks.1.attn@3-12", steps=16, fp16_advice_backoffs=5), tmp_path / "run")
    advice = _events(tmp_path / "run", "fp16_advice")
    assert len(advice) == 1 and "bf16" in advice[0]["message"] and "lr" in advice[0]["message"]
    assert len([e for e in _events(tmp_path / "run", "loss_scale") if e["cause"] == "overflow"]) == 10
