"""`kiln profile`: the parts add up to the step, and planted bottlenecks are named for what they are."""
import json

import pytest

from kiln.cli.main import main
from kiln.perf.bottleneck import MATMUL_OPS, Breakdown, Op, verdict
from kiln.run.profile import PARTS, profile_run


def _profile(small_config, tmp_path, steps=5, **sections):
    cfg = small_config(**sections)
    return profile_run(cfg, tmp_path / "run", steps=steps, warmup=2, log=lambda m: None)


def test_a_slow_data_source_is_data_bound_and_its_wait_measured(small_config, tmp_path):
    r = _profile(small_config, tmp_path, faults={"data_delay_ms": 60.0})
    assert r.verdict.kind == "data-bound", r.verdict
    assert r.breakdown.parts["data"] == pytest.approx(0.060, rel=0.10)  # the injected delay, one micro-batch a step
    assert "data.prefetch" in r.verdict.advice[0]


def test_a_tiny_model_and_batch_is_host_overhead_bound(small_config, tmp_path):
    r = _profile(small_config, tmp_path, model={"n_layer": 1, "d_model": 32, "n_head": 2},
                 data={"seq_len": 8}, train={"micro_batch_size": 1})
    assert r.verdict.kind == "host-overhead-bound", (r.verdict, r.breakdown.parts)
    assert "train.micro_batch_size to 2" in r.verdict.advice[0] and "fits" in r.verdict.advice[0]


def test_wide_matmuls_are_compute_bound_and_the_parts_add_up(small_config, tmp_path, kiln_cache):
    r = _profile(small_config, tmp_path, model={"n_layer": 2, "d_model": 384, "n_head": 6, "max_seq_len": 128},
                 data={"seq_len": 128}, train={"micro_batch_size": 8})
    b = r.breakdown
    assert r.verdict.kind == "compute-bound", (r.verdict, b.parts)
    assert abs(b.unaccounted_s) <= 0.05 * b.step_s, (b.step_s, b.parts)  # the parts are the step, within 5%
    assert set(b.parts) == set(PARTS) and b.parts["forward"] > 0 and b.parts["backward"] > 0
    summary = json.loads((tmp_path / "run" / "profile" / "summary.json").read_text())
    assert summary["verdict"] == "compute-bound" and summary["step_s"] == b.step_s
    assert (tmp_path / "run" / "profile" / "trace.json").stat().st_size > 1000
    top = summary["top_ops"][0]
    assert top["name"] in MATMUL_OPS and top["flops"] > 0 and top["intensity"] > 1  # mm, or oneDNN's linear
    # MFU and the ridge point divide by the rate torch reaches on the model's own linears (measured, cached), and the
    # bf16 rate is printed whatever the run's precision
    rates = summary["matmul_rates"]
    assert set(rates) == {"fp32", "bf16"} and min(rates.values()) > 0
    assert summary["peak_flops"] >= rates["fp32"] and 0 < summary["mfu"] <= 1
    stored = json.loads((kiln_cache / "measured.json").read_text())["matmul_flops"]
    assert rates["fp32"] in [v for k, v in stored.items() if "| fp32 " in k]  # a linear shape or the square


def test_the_rules_in_order():
    def b(parts, ops, flops=1e9, device="cpu", idle=None):
        return Breakdown(step_s=0.1, parts=parts, ops=ops, device=device, peak_flops=1e11, bandwidth=1e10,
                         model_flops_per_step=flops, device_idle_share=idle)

    mm = Op("aten::mm", 10, 0.06, 1e9, 1e7)
    add = Op("aten::add", 10, 0.03, 0, 1e8)
    assert verdict(b({"data": 0.03}, [mm, add])).kind == "data-bound"
    assert verdict(b({"data": 0.0}, [mm, add])).kind == "compute-bound"
    assert verdict(b({}, [Op("aten::mm", 1, 0.01, 1e9, 1e7), Op("aten::gelu", 1, 0.05, 0, 1e9)])).kind \
        == "memory-bandwidth-bound"
    many_small = [Op("aten::add", 5000, 0.05, 0, 1e3)]  # 10 µs each, 0.1 GFLOP/s of 100
    assert verdict(b({}, many_small, flops=1e7)).kind == "host-overhead-bound"
    assert verdict(b({}, [mm], device="cuda", idle=0.5)).kind == "host-overhead-bound"


@pytest.mark.parametrize("argv, fragment", [(["profile", "--steps=0"], "--steps must be ≥ 1"),
                                            (["profile", "--warmup=-1"], "--warmup must be ≥ 0")])
def test_bad_profile_arguments(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err
