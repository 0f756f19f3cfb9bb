"""bf16 on any CPU: native-bf16 detection from cpuinfo flags, auto from measured matmul rates, and `kiln memory` /
`kiln plan` for every precision on a CPU that has no bf16 instructions (flags and rates injected, not the host's)."""
import json

import pytest
import torch

from kiln.cli.main import main
from kiln.memory import devices
from kiln.memory.levers import precision_for
from kiln.perf import flops, hardware
from kiln.perf.hardware import auto_mode, native_bf16, precision_notice, resolve_mode
from kiln.precision import PRECISIONS
from kiln.train.precision import MODES

CPU = torch.device("cpu")

# /proc/cpuinfo flag lines of real CPUs (abridged only where nothing bf16-related was cut).
ZEN3 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
        "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid extd_apicid "
        "aperfmperf rapl pni pclmulqdq monitor ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand "
        "lahf_lm cmp_legacy svm extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce "
        "topoext perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3 cdp_l3 hw_pstate ssbd mba ibrs ibpb "
        "stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a rdseed adx smap clflushopt clwb sha_ni "
        "xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc clzero irperf xsaveerptr rdpru wbnoinvd arat npt "
        "lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid decodeassists pausefilter pfthreshold avic "
        "v_vmsave_vmload vgif v_spec_ctrl umip pku ospke vaes vpclmulqdq rdpid overflow_recov succor smca fsrm")
COOPER_LAKE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr "
               "sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts "
               "rep_good nopl xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl vmx smx "
               "est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt "
               "tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb cat_l3 "
               "cdp_l3 invpcid_single intel_ppin ssbd mba ibrs ibpb stibp ibrs_enhanced tpr_shadow vnmi "
               "flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm cqm "
               "mpx rdt_a avx512f avx512dq rdseed adx smap clflushopt clwb intel_pt avx512cd avx512bw avx512vl "
               "xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local avx512_bf16 "
               "dtherm ida arat pln pts pku ospke avx512_vnni md_clear flush_l1d arch_capabilities")
SAPPHIRE_RAPIDS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
                   "sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon rep_good nopl xtopology "
                   "nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe "
                   "popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch "
                   "cpuid_fault invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 "
                   "smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd "
                   "sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat "
                   "avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
                   "tme avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm "
                   "md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities")
GRAVITON3 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
             "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm "
             "svebf16 i8mm bf16 dgh rng")
GRAVITON2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"


def x86_cpuinfo(flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n"
            f"\nprocessor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n")


def arm_cpuinfo(features: str) -> str:
    return f"processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("flags,cap,expected", [
    (ZEN3, None, None),
    (COOPER_LAKE, None, "AVX512-BF16"),
    (SAPPHIRE_RAPIDS, None, "AMX"),
    (SAPPHIRE_RAPIDS, "ALL", "AMX"),
    (SAPPHIRE_RAPIDS, "AVX512_CORE_BF16", "AVX512-BF16"),  # AMX capped away, AVX512-BF16 still allowed
    (SAPPHIRE_RAPIDS, "avx10_1_512_amx", "AMX"),
    (SAPPHIRE_RAPIDS, "AVX512_CORE", None),
    (COOPER_LAKE, "AVX2", None),
    (GRAVITON3, None, "Arm BF16"),
    (GRAVITON3, "AVX2", "Arm BF16"),  # oneDNN's x86 cap says nothing about an Arm CPU
    (GRAVITON2, None, None),
], ids=["zen3", "cooper-lake", "sapphire-rapids", "spr-cap-all", "spr-cap-avx512-bf16", "spr-cap-avx10-amx",
        "spr-cap-avx512-core", "cooper-lake-cap-avx2", "graviton3", "graviton3-x86-cap", "graviton2"])
def test_native_bf16_from_flags(flags, cap, expected):
    cap = cap or ""  # "" is no cap: never the environment's, so the host cannot change the answer
    assert native_bf16(flags, isa_cap=cap) == expected
    assert native_bf16(set(flags.split()), isa_cap=cap) == expected
    whole = arm_cpuinfo(flags) if "asimd" in flags else x86_cpuinfo(flags)
    assert native_bf16(whole, isa_cap=cap) == expected


def test_native_bf16_reads_cpuinfo_and_the_onednn_cap(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text(x86_cpuinfo(SAPPHIRE_RAPIDS))
    monkeypatch.setattr(hardware, "CPUINFO", path)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert native_bf16() == "AMX"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the AVX2-only emulation of docs/training.md
    assert native_bf16() is None
    monkeypatch.setattr(hardware, "CPUINFO", tmp_path / "missing")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert native_bf16() is None


@pytest.mark.parametrize("fp32,bf16,expected", [
    (327e9, 167e9, "fp32"),  # native AVX512-BF16 at half fp32's rate (the 2-core Xeon of docs/training.md)
    (140e9, 1e9, "fp32"),  # emulated (AVX2 only)
    (100e9, 110e9, "fp32"),  # faster, but not by enough to pay for autocast's casts
    (100e9, 120e9, "bf16"),
    (100e9, 400e9, "bf16"),  # AMX
    (228e9, 1005e9, "bf16"),  # AVX512-BF16 on Zen 5 (2026-11-27): printed 1,005, not 1e+03
])
def test_auto_on_cpu_follows_measured_rates(fp32, bf16, expected):
    mode, why = auto_mode("cpu", rates={"fp32": fp32, "bf16": bf16})
    assert mode == expected
    shown = {r: f"{r / 1e9:,.0f}" if r >= 100e9 else f"{r / 1e9:.3g}" for r in (fp32, bf16)}
    assert f"bf16 matmul {shown[bf16]} GFLOP/s vs fp32 {shown[fp32]} GFLOP/s" in why
    assert "e+" not in why


def test_auto_on_cuda_follows_compute_capability():
    assert auto_mode("cuda", 8.0)[0] == auto_mode("cuda", 9.0)[0] == "bf16"
    assert auto_mode("cuda", 7.0)[0] == "fp32"
    assert precision_for("auto", devices.get_device("H100")) == "bf16"
    assert precision_for("auto", devices.get_device("V100")) == "fp32"


@pytest.fixture
def fake_cpu(monkeypatch, tmp_path):
    """Make this process see a CPU with the given cpuinfo and measured matmul rates (FLOP/s by precision); the
    planner's bandwidth is fixed at 20 GB/s so nothing is measured."""

    def make(cpuinfo: str, rates: dict[str, float]):
        path = tmp_path / "cpuinfo"
        path.write_text(cpuinfo)
        monkeypatch.setattr(hardware, "CPUINFO", path)
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        monkeypatch.setattr(flops, "_cpu_peak_cache", {PRECISIONS[p].cpu_matmul: r for p, r in rates.items()})
        monkeypatch.setattr(devices, "_cpu_cache", {})
        monkeypatch.setattr(devices, "measured_bandwidth", lambda: 20e9)

    return make


ZEN3_RATES = {"fp32": 140e9, "bf16": 1e9, "fp16": 1e9}  # AVX2 only: half precision emulated, ~100x slower
AMX_RATES = {"fp32": 100e9, "bf16": 400e9, "fp16": 100e9}


@pytest.mark.parametrize("cpuinfo,rates,auto", [(x86_cpuinfo(ZEN3), ZEN3_RATES, "fp32"),
                                                (x86_cpuinfo(SAPPHIRE_RAPIDS), AMX_RATES, "bf16")],
                         ids=["zen3", "sapphire-rapids"])
def test_one_auto_rule_for_train_and_planner(fake_cpu, cpuinfo, rates, auto):
    fake_cpu(cpuinfo, rates)
    cpu = devices.cpu_device()
    assert cpu.peak_flops == rates  # every precision measured, emulated or not
    assert resolve_mode("auto", CPU) == precision_for("auto", cpu) == auto
    for mode in MODES[1:]:  # the table says a mode runs exactly when kiln train runs it
        try:
            resolve_mode(mode, CPU)
            trains = True
        except ValueError:
            trains = False
        assert cpu.supports(mode) == trains, mode
        assert trains == (mode not in ("tf32", "fp8"))  # both need CUDA
    # MFU's peak is the measured rate of the precision in use
    assert flops.device_peak_flops(CPU, "bf16-master") == flops.device_peak_flops(CPU, "bf16") == rates["bf16"]
    assert flops.device_peak_flops(CPU, "fp16") == rates["fp16"]
    assert flops.device_peak_flops(CPU, "fp32") == rates["fp32"]


def test_notice_says_emulated_once_per_mode(fake_cpu):
    fake_cpu(x86_cpuinfo(ZEN3), ZEN3_RATES)
    assert precision_notice("auto", CPU) == ("precision auto → fp32: bf16 matmul 1 GFLOP/s vs fp32 140 GFLOP/s on "
                                             "this CPU (auto takes bf16 from 1.2x fp32's rate)")
    for mode in ("bf16", "bf16-master"):
        note = precision_notice(mode, CPU)
        assert "bf16 is emulated on this CPU" in note and "140x slower than fp32" in note and "\n" not in note
    assert "fp16 matmul 1 GFLOP/s vs fp32 140 GFLOP/s, 140x slower" in precision_notice("fp16", CPU)
    assert precision_notice("fp32", CPU) is None
    assert precision_notice("bf16", torch.device("meta")) is None


def test_notice_on_native_bf16(fake_cpu):
    fake_cpu(x86_cpuinfo(SAPPHIRE_RAPIDS), AMX_RATES)
    assert precision_notice("bf16", CPU) is None  # native and 4x fp32: nothing to say
    assert precision_notice("auto", CPU).startswith("precision auto → bf16: bf16 matmul 400 GFLOP/s")
    fake_cpu(x86_cpuinfo(COOPER_LAKE), {"fp32": 327e9, "bf16": 167e9, "fp16": 320e9})
    assert precision_notice("bf16", CPU) == ("precision bf16: bf16 on this CPU runs natively (AVX512-BF16) but is "
                                             "slower than fp32: bf16 matmul 167 GFLOP/s vs fp32 327 GFLOP/s, 1.96x "
                                             "slower than fp32")


SMALL = ["--model.n_layer=3", "--model.d_model=96", "--model.n_head=4", "--data.seq_len=48",
         "--train.micro_batch_size=4", "--train.device=cpu", "--device=cpu"]


def _memory(capsys, mode: str) -> dict:
    assert main(["memory", *SMALL, f"--precision.mode={mode}", "--json", "--out", ""]) == 0
    return json.loads(capsys.readouterr().out)


def test_kiln_memory_every_precision_without_bf16(fake_cpu, capsys):
    """Estimating bf16 is arithmetic: every mode runs on a CPU without bf16, and the bytes follow the dtypes."""
    fake_cpu(x86_cpuinfo(ZEN3), ZEN3_RATES)
    out = {mode: _memory(capsys, mode) for mode in ("fp32", "bf16", "bf16-master", "fp16", "auto")}
    comp = {mode: o["components"] for mode, o in out.items()}
    n = out["fp32"]["param_count"]
    assert comp["fp32"]["parameters"] == comp["bf16"]["parameters"] == comp["fp16"]["parameters"] == 4 * n
    assert comp["bf16-master"]["parameters"] == 2 * n  # bf16 weights: half of fp32's
    assert comp["bf16-master"]["master_weights"] == 4 * n and comp["fp32"]["master_weights"] == 0
    states = {c["optimizer_states"] for c in comp.values()}  # AdamW's two fp32 moments (+ a 4-byte step each)
    assert len(states) == 1 and 8 * n < states.pop() < 8 * n + 4 * 100
    # autocast saves 2-byte matmul outputs (fp16 and bf16 alike) but keeps the residual stream in fp32
    assert comp["fp16"]["activations"] == comp["bf16"]["activations"]
    assert comp["fp32"]["activations"] / 2 < comp["bf16"]["activations"] < comp["fp32"]["activations"]
    assert comp["bf16-master"]["activations"] < comp["bf16"]["activations"]
    assert out["auto"]["precision"] == "fp32" and comp["auto"] == comp["fp32"]
    assert "bf16 is emulated on this CPU" in out["bf16"]["precision_note"]
    assert out["auto"]["precision_note"].startswith("precision auto → fp32")
    assert main(["memory", *SMALL, "--precision.mode=bf16", "--out", ""]) == 0  # the table says it too
    assert "note: precision bf16: bf16 is emulated on this CPU" in capsys.readouterr().out


def test_kiln_memory_auto_is_bf16_where_bf16_is_fast(fake_cpu, capsys):
    fake_cpu(x86_cpuinfo(SAPPHIRE_RAPIDS), AMX_RATES)
    auto, bf16 = _memory(capsys, "auto"), _memory(capsys, "bf16")
    assert auto["precision"] == "bf16" and auto["components"] == bf16["components"]


def _plan(capsys) -> tuple[int, dict]:
    code = main(["plan", *SMALL, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_kiln_plan_without_bf16(fake_cpu, capsys):
    """The planner considers bf16 on a CPU without it and ranks it by its measured (emulated) rate."""
    fake_cpu(x86_cpuinfo(ZEN3), ZEN3_RATES)
    code, out = _plan(capsys)
    assert code == 0 and out["device_peak_flops"] == ZEN3_RATES
    best = {}
    for c in out["candidates"]:
        mode = c["overrides"]["precision.mode"]
        best[mode] = min(best.get(mode, float("inf")), c["predicted_step_s"])
    assert set(best) == {"fp32", "bf16", "bf16-master"}
    assert out["best"]["overrides"]["precision.mode"] == "fp32"
    assert best["bf16"] > 5 * best["fp32"]  # compute at 1 vs 140 GFLOP/s
    assert main(["plan", *SMALL]) == 0
    assert "matmul GFLOP/s measured on this CPU: fp32 140, bf16 1 (emulated), fp16 1" in capsys.readouterr().out


def test_kiln_plan_picks_bf16_where_bf16_is_fast(fake_cpu, capsys):
    fake_cpu(x86_cpuinfo(SAPPHIRE_RAPIDS), AMX_RATES)
    code, out = _plan(capsys)
    assert code == 0 and out["best"]["overrides"]["precision.mode"] in ("bf16", "bf16-master")


def test_cpu_peak_measures_emulated_bf16_at_a_small_size(monkeypatch):
    """The size adapts so one dtype's measurement stays short: at 1 GFLOP/s (emulated bf16) a 1024³ product
    would take 2.1 s, so it stays at 256³ (34 ms); at 300 GFLOP/s it reaches 1024³ as before."""
    for rate, n_expected in ((1e9, 256), (20e9, 512), (300e9, 1024)):
        sizes = []

        def fake(a, b, rate=rate):  # a CPU that multiplies at `rate`, without the wait
            sizes.append(a.shape[0])
            return 2 * a.shape[0] ** 3 / rate

        monkeypatch.setattr(flops, "_matmul_seconds", fake)
        monkeypatch.setattr(flops, "_cpu_peak_cache", {})
        assert flops.measured_cpu_peak(torch.bfloat16, seconds=0.01) == pytest.approx(rate)
        assert max(sizes) == n_expected
        probe_s = sum(2 * n**3 / rate for n in sizes[:sizes.index(n_expected) + 2])  # before the timed window
        assert probe_s < 0.25
