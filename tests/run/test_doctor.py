"""`kiln doctor`: the default configuration passes; each broken setup fails its own check, with the fix."""
import json

import pytest

from kiln.cli.main import main
from kiln.config import to_toml
from kiln.run.doctor import CHECKS, run_checks


def test_default_configuration_has_no_failure(corpus_file, kiln_cache, capsys):
    # The default model, optimizer, schedule and precision; only the text (a smaller corpus) and device differ.
    code = main(["doctor", "--json", f"--data.source={corpus_file}", "--train.device=cpu"])
    checks = json.loads(capsys.readouterr().out)["checks"]
    assert [c["name"] for c in checks] == [name for _, name, _ in CHECKS]
    assert all(set(c) >= {"number", "name", "status", "value", "fix"} for c in checks)
    failed = [c for c in checks if c["status"] == "fail"]
    assert not failed, failed
    assert code == 0
    by_name = {c["name"]: c for c in checks}
    assert by_name["init_loss"]["value"].startswith("5.")  # ln(256) = 5.545
    assert by_name["overfit_one_batch"]["status"] == "pass"


BROKEN = [
    ({"unshifted_labels": True}, "targets_shifted", "targets == inputs"),
    ({"frozen_module": "blocks.1.mlp"}, "gradient_flow", "blocks.1.mlp.fc.weight"),
    ({"skip_zero_grad": True}, "grads_cleared", "still hold the last step's gradient"),
]


@pytest.mark.parametrize("fault, check, evidence", BROKEN, ids=[b[1] for b in BROKEN])
def test_each_broken_setup_fails_its_check(small_config, tmp_path, capsys, fault, check, evidence):
    path = tmp_path / "broken.toml"
    path.write_text(to_toml(small_config(faults=fault, optim={"lr": 3e-3})))  # memorizes the batch sooner
    code = main(["doctor", str(path)])
    out = capsys.readouterr().out
    assert code == 1
    line = next(line for line in out.splitlines() if check in line)
    assert "FAIL" in line and evidence in line
    fix = out.splitlines()[out.splitlines().index(line) + 1]
    assert fix.strip().startswith("fix: ")


def test_small_clean_setup_passes_every_check(small_config):
    checks = run_checks(small_config(optim={"lr": 3e-3}), log=lambda msg: None)
    assert {c.status for c in checks} <= {"pass", "warn"}, [c for c in checks if c.status == "fail"]
    assert [c.number for c in checks] == list(range(1, len(CHECKS) + 1))


def test_missing_warmup_warns(small_config):
    cfg = small_config(schedule={"warmup_steps": 0}, optim={"lr": 3e-3})
    checks = {c.name: c for c in run_checks(cfg, log=lambda msg: None)}
    assert checks["warmup"].status == "warn" and "warmup_steps" in checks["warmup"].fix


def test_a_slow_data_source_warns_on_utilisation(small_config):
    slow = {c.name: c for c in run_checks(small_config(faults={"data_delay_ms": 40.0}), log=lambda msg: None)}
    assert slow["utilisation"].status == "warn" and "data.prefetch" in slow["utilisation"].fix
    assert "ms waiting for each batch" in slow["utilisation"].value
    fast = {c.name: c for c in run_checks(small_config(), log=lambda msg: None)}
    assert fast["utilisation"].status == "pass", fast["utilisation"].value


def test_data_finite_keeps_the_rotary_cache_of_a_llama_model(small_config, tmp_path):
    """The check's hook on the first block only looks at the embedded inputs: it must not drop the block's other
    argument (Llama's rotary cos/sin), which once made every Llama model fail with a TypeError."""
    from kiln.run.doctor import Doctor
    from kiln.run.lm import build_lm

    cfg = small_config(model={"arch": "llama", "n_kv_head": 1, "rope_theta": 10000.0})
    lm = build_lm(cfg, tmp_path, log=lambda msg: None)
    try:
        status, value, _ = Doctor(lm, None).data_finite()
    finally:
        lm.state.loader.close()
    assert (status, value.split(";")[0]) == ("pass", "integer token ids (NaN/Inf cannot occur)")
    assert "embedded inputs finite (absmax" in value


def test_weight_std_takes_the_zero_initialised_projections_expected_std(small_config, tmp_path):
    """model.zero_init_proj: the output projections start at 0 (the model's init_std says so); the check passes
    them at 0 and names one that is not. With the recipe's other parts on (relu2, QK-norm gains at 1, a cap)."""
    import torch

    from kiln.run.doctor import Doctor
    from kiln.run.lm import build_lm

    parts = {"zero_init_proj": True, "mlp": "relu2", "qk_norm": True, "logit_softcap": 15.0}
    lm = build_lm(small_config(model=parts), tmp_path, log=lambda msg: None)
    try:
        doctor = Doctor(lm, None)
        status, value, _ = doctor.weight_std()
        assert status == "pass", value
        assert doctor.model.blocks[0].attn.q_norm is not None  # the parts are on: their gains were checked too
        with torch.no_grad():
            doctor.model.blocks[0].mlp.proj.weight.fill_(0.5)
        status, value, _ = doctor.weight_std()
    finally:
        lm.state.loader.close()
    assert status == "fail" and "blocks.0.mlp.proj.weight: max |w| = 0.5 (starts at 0)" in value, value
