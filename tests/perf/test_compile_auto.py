"""train.compile = auto | true | false: auto compiles when the measured compile time is repaid over the run, and
config.toml records the resolved value and why."""
import tomllib

import pytest
import torch

from kiln.config import ConfigError, load_config
from kiln.perf import compile as comp
from kiln.perf.compile import compile_setting, decide_compile, record_compile

CPU = torch.device("cpu")
KEY = "fp32 gpt2 layers 6 d_model 384 heads 6 vocab 256 rows 2048"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    monkeypatch.setattr(comp, "cpu_compiler", lambda: "g++")
    return tmp_path


@pytest.mark.parametrize("value, setting", [(True, "true"), (False, "false"), ("auto", "auto"), ("TRUE", "true"),
                                            ("false", "false")])
def test_settings_old_booleans_included(value, setting):
    assert compile_setting(value) == setting


def test_an_unknown_setting_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=r"train.compile='sometimes'; use auto, true or false"):
        load_config(None, ["--train.compile=sometimes"])


def test_true_and_false_are_kept_whatever_was_measured(cache):
    record_compile(KEY, 1000.0, 1.0, 0.9)  # would never pay in 10 steps
    assert decide_compile(True, CPU, KEY, steps=10) == (True, "train.compile=true")
    assert decide_compile("false", CPU, KEY, steps=10 ** 6) == (False, "train.compile=false")


def test_auto_without_a_measurement_stays_eager_and_says_how_to_measure(cache):
    on, why = decide_compile("auto", CPU, KEY, steps=10 ** 6)
    assert not on and "benchmarks/compile_gain.py" in why


def test_auto_compiles_when_the_steps_repay_the_compile_time(cache):
    record_compile(KEY, 60.0, 1.0, 0.8)  # 0.2 s saved a step: pays after 300 steps
    assert decide_compile("auto", CPU, KEY, steps=301)[0]
    on, why = decide_compile("auto", CPU, KEY, steps=299)
    assert not on and "less than the compile time" in why and "compile 60 s" in why
    assert not decide_compile("auto", CPU, "bf16 " + KEY[5:], steps=10 ** 6)[0]  # another precision: not measured


def test_auto_never_compiles_what_is_no_faster(cache):
    record_compile(KEY, 1.0, 1.0, 1.0)
    on, why = decide_compile("auto", CPU, KEY, steps=10 ** 6)
    assert not on and "no faster" in why


def test_a_time_budget_spends_at_most_a_quarter_compiling(cache):
    record_compile(KEY, 40.0, 1.0, 0.5)  # in 120 s: 120 steps save 60 s > 40 s, but 40 s > 30 s of compiling
    on, why = decide_compile("auto", CPU, KEY, time_budget=120.0)
    assert not on and "25%" in why
    assert decide_compile("auto", CPU, KEY, time_budget=200.0)[0]  # 40 s ≤ 50 s, and 200 steps save 100 s


def test_no_cpp_compiler_is_said_in_the_reason(cache, monkeypatch):
    record_compile(KEY, 1.0, 1.0, 0.5)
    monkeypatch.setattr(comp, "cpu_compiler", lambda: None)
    on, why = decide_compile("auto", CPU, KEY, steps=10 ** 6)
    assert not on and "no C++ compiler" in why


def test_the_cpp_compiler_is_found_on_the_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert comp.cpu_compiler() is None
    (tmp_path / "g++").write_text("#!/bin/sh\n")
    (tmp_path / "g++").chmod(0o755)
    assert comp.cpu_compiler() == "g++"


def test_config_toml_records_the_resolved_value_and_why(small_config, tmp_path, monkeypatch, cache):
    from kiln.run.lm import build_lm, train

    cfg = small_config(train={"max_steps": 3, "compile": "auto"})
    lm = build_lm(cfg, tmp_path / "probe", log=lambda m: None)  # the key of this shape, as train computes it
    rows = lm.cfg.train.micro_batch_size * lm.cfg.data.seq_len
    lm.state.world.close()
    record_compile(comp.compile_key(lm.cfg.model, lm.cfg.precision.mode, rows), 30.0, 0.010, 0.011)
    train(cfg, tmp_path / "run")
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())["train"]
    assert saved["compile"] is False and saved["compile_decided_by"].startswith("auto: off, compiled steps are no")
    # the resumed run keeps the recorded value and its reason, whatever is measured now
    record_compile(comp.compile_key(lm.cfg.model, lm.cfg.precision.mode, rows), 0.0, 1.0, 0.1)
    resumed = train(load_config(tmp_path / "run" / "config.toml", ["--train.max_steps=4"]), tmp_path / "run",
                    resume=True)
    assert resumed.cfg.train.compile is False
    assert resumed.cfg.train.compile_decided_by == saved["compile_decided_by"]


def test_an_override_on_a_recorded_run_says_so(small_config):
    from dataclasses import replace

    from kiln.run.lm import recorded_compile

    cfg = small_config(model={"vocab_size": 256})  # resolved, as kiln train has it when it decides
    recorded = replace(cfg, train=replace(cfg.train, compile=False, compile_decided_by="auto: off, no gain"))
    assert recorded_compile(recorded, CPU).compile_decided_by == "auto: off, no gain"  # a resume keeps its words
    overridden = replace(cfg, train=replace(cfg.train, compile="true", compile_decided_by="auto: off, no gain"))
    tc = recorded_compile(overridden, CPU)
    assert tc.compile is True and tc.compile_decided_by == "train.compile=true"
