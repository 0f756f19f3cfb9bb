"""Measurements kept per machine (kiln.perf.measured) and the model-shape matmul peak that uses them: measured once,
read back by later calls (a new process), measured again for another key or another machine."""
import json

import pytest

from kiln.perf import measured, peak


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    monkeypatch.setattr(peak, "_cache", {})  # the in-process memo: each test starts as a new process would
    monkeypatch.setattr(peak, "_timed_here", set())
    return tmp_path / "measured.json"


@pytest.fixture
def counted(monkeypatch):
    """_measure_linear replaced by a counter: the n-th measurement returns n GFLOP/s."""
    calls = []

    def fake(key):
        m, k, n, precision, onednn = key
        calls.append((m, k, n, precision))
        peak._timed_here.add(key)
        return len(calls) * 1e9

    monkeypatch.setattr(peak, "_measure_linear", fake)
    return calls


def test_a_rate_is_measured_once_then_read_back(cache, counted, monkeypatch):
    assert peak.linear_rate(512, 256, 768, "fp32") == 1e9
    assert counted == [(512, 256, 768, "fp32")] and cache.is_file()
    monkeypatch.setattr(peak, "_cache", {})  # a later run: nothing in memory, the file is there
    assert peak.linear_rate(512, 256, 768, "fp32") == 1e9
    assert len(counted) == 1
    stored = json.loads(cache.read_text())["matmul_flops"]
    assert list(stored.values()) == [1e9]
    assert "torch " in next(iter(stored))  # the key names the torch build


@pytest.mark.parametrize("other", [(512, 256, 768, "bf16"), (512, 256, 1024, "fp32"), (256, 256, 768, "fp32")],
                         ids=["precision", "shape", "rows"])
def test_another_key_is_measured_again(cache, counted, other):
    peak.linear_rate(512, 256, 768, "fp32")
    assert peak.linear_rate(*other) == 2e9
    assert len(counted) == 2
    assert len(json.loads(cache.read_text())["matmul_flops"]) == 2  # both kept


def test_another_machine_is_measured_again(cache, counted, monkeypatch):
    peak.linear_rate(512, 256, 768, "fp32")
    monkeypatch.setattr(peak, "_cache", {})
    monkeypatch.setattr(measured, "cpu_model", lambda: "Some Other CPU")
    assert peak.linear_rate(512, 256, 768, "fp32") == 2e9
    monkeypatch.setattr(measured.torch, "get_num_threads", lambda: 64)  # same CPU model, other thread count
    monkeypatch.setattr(peak, "_cache", {})
    assert peak.linear_rate(512, 256, 768, "fp32") == 3e9


def test_a_damaged_cache_file_is_measured_around(cache, counted):
    cache.write_text("{not json")
    assert peak.linear_rate(512, 256, 768, "fp32") == 1e9
    assert json.loads(cache.read_text())["matmul_flops"]  # rewritten whole


def test_a_real_measurement_is_stored_and_the_model_peak_is_its_best_shape(cache):
    from kiln.models.gpt2 import PRESETS

    cfg = PRESETS["nano"].resolve()
    cfg.vocab_size = 256
    first = peak.model_peak_flops(peak.torch.device("cpu"), "fp32", cfg, 256)
    stored = json.loads(cache.read_text())["matmul_flops"]
    assert len(stored) == len(peak.linear_shapes(cfg, 256)) + 1  # and the square product
    assert first == max(stored.values()) > 1e8
    peak._cache.clear()
    assert peak.model_peak_flops(peak.torch.device("cpu"), "fp32", cfg, 256) == first  # read back exactly


def test_a_low_first_measurement_rises_when_a_later_run_measures_more(cache, monkeypatch):
    """A peak measured while the machine was busy must not stay low for good: each run times the shape that sets
    the peak once more and keeps the higher of the two."""
    from kiln.models.gpt2 import PRESETS

    cfg = PRESETS["nano"].resolve()
    cfg.vocab_size = 256
    cpu = peak.torch.device("cpu")
    rates = iter([1e9, 2e9, 3e9, 4e9, 9e9, 0.5e9])  # four shapes, then the refresh of the fastest (4e9) finds 9e9

    def fake(key):
        peak._timed_here.add(key)
        return next(rates)

    monkeypatch.setattr(peak, "_measure_linear", fake)
    monkeypatch.setattr(peak, "square_rate", lambda precision: 1.0)
    assert len(peak.linear_shapes(cfg, 256)) == 4
    assert peak.model_peak_flops(cpu, "fp32", cfg, 256) == 4e9  # the first run: measured, no refresh
    monkeypatch.setattr(peak, "_cache", {})
    monkeypatch.setattr(peak, "_timed_here", set())
    assert peak.model_peak_flops(cpu, "fp32", cfg, 256) == 9e9  # a later run: the fastest shape timed again, higher
    assert max(json.loads(cache.read_text())["matmul_flops"].values()) == 9e9  # and stored
    monkeypatch.setattr(peak, "_cache", {})
    monkeypatch.setattr(peak, "_timed_here", set())
    assert peak.model_peak_flops(cpu, "fp32", cfg, 256) == 9e9  # a slower sample (0.5e9) never lowers it


def test_precision_auto_and_the_notice_read_the_stored_square_rates(cache, monkeypatch):
    """precision.mode=auto and the CPU precision notice take the square-matmul rates kiln stored for this machine
    (the MFU peak's entries) instead of timing fp32 and bf16 again at every start; what this process measured
    itself still comes first, and a machine with nothing stored measures once and stores it."""
    from kiln.perf import flops, hardware

    monkeypatch.setattr(flops, "_cpu_peak_cache", {})
    measured.store("matmul_flops", "fp32 square", 100e9)
    measured.store("matmul_flops", "bf16 square", 400e9)
    timed = []

    def fake(dtype=flops.torch.float32, **kw):
        timed.append(dtype)
        return 7e9

    monkeypatch.setattr(flops, "measured_cpu_peak", fake)
    cpu = flops.torch.device("cpu")
    assert hardware.decide_mode("auto", cpu)[0] == "bf16"
    assert "bf16 matmul 400 GFLOP/s vs fp32 100 GFLOP/s" in hardware.precision_notice("auto", cpu)
    assert timed == []
    monkeypatch.setattr(flops, "_cpu_peak_cache", {flops.torch.bfloat16: 50e9})  # measured in this process: first
    assert hardware.decide_mode("auto", cpu)[0] == "fp32"
    assert timed == []
    cache.unlink()  # a new machine: measured once, stored, then read back
    monkeypatch.setattr(flops, "_cpu_peak_cache", {})
    assert flops.stored_cpu_peak("fp16") == 7e9 and timed == [flops.torch.float16]
    monkeypatch.setattr(flops, "_cpu_peak_cache", {})
    assert flops.stored_cpu_peak("fp16") == 7e9 and timed == [flops.torch.float16]
    assert json.loads(cache.read_text())["matmul_flops"]
