"""What the hardware runs fast: native bf16 on a CPU, and the precision precision.mode=auto resolves to.

    native_bf16(flags, isa_cap)     "AMX" | "AVX512-BF16" | "Arm BF16" | None (emulated)
    auto_mode(kind, capability, rates)  precision.mode=auto's one rule, for kiln train and the planner
    resolve_mode(mode, device)      the concrete precision of a mode on a torch device
    decide_mode(mode, device)       the same and what decided it (recorded in a run's config)
    precision_notice(mode, device)  one console line about bf16/fp16 on this CPU
    resolve_kernels(kernels, device)    "torch" or "triton" for train.kernels (no Triton import)
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.perf.flops import stored_cpu_peak
from kiln.precision import PRECISIONS, is_auto

CPUINFO = Path("/proc/cpuinfo")  # where native_bf16() reads the CPU's flags (x86) or Features (aarch64)

# oneDNN's CPU ISA ladder, as ONEDNN_MAX_CPU_ISA names it (dnnl_cpu_isa_t, low to high; AVX10_1 names are the
# same levels). A cap below a level means oneDNN never emits that level's instructions, even where the CPU has them.
_ONEDNN_ISA = {name: rank for rank, names in enumerate((
    ("SSE41",), ("AVX",), ("AVX2",), ("AVX2_VNNI",), ("AVX2_VNNI_2",), ("AVX512_CORE",), ("AVX512_CORE_VNNI",),
    ("AVX512_CORE_BF16",), ("AVX512_CORE_FP16", "AVX10_1_512"), ("AVX512_CORE_AMX", "AVX10_1_512_AMX"),
    ("AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16"))) for name in names}
# What provides bf16 dot products in hardware: (cpuinfo flag, name, the oneDNN level that uses it), best first.
_BF16_UNITS = (("amx_bf16", "AMX", "AVX512_CORE_AMX"), ("avx512_bf16", "AVX512-BF16", "AVX512_CORE_BF16"),
               ("bf16", "Arm BF16", None))  # aarch64's Features: oneDNN's x86 cap does not apply

# auto picks bf16 on a CPU only when its measured matmul rate beats fp32's by this much: autocast adds casts
# and keeps norms, softmax and the loss in fp32, so a bf16 matmul barely faster than fp32 buys no step time.
# Measured: AMX, bf16 matmul 4.4x fp32 -> step 2.1-2.3x faster (docs/benchmarks.md); a 2-core AVX512-BF16
# Xeon without AMX, bf16 matmul 0.5x fp32 (167 vs 327 GFLOP/s) -> 1,800 tok/s in bf16 vs 2,900 in fp32.
BF16_CPU_MIN_SPEEDUP = 1.2


def _cpu_flags(flags: set[str] | str | None) -> set[str]:
    """The flag set from a set, a flags/Features line, a whole /proc/cpuinfo text, or (None) this machine's."""
    if flags is None:
        try:
            flags = CPUINFO.read_text()
        except OSError:
            return set()
    if not isinstance(flags, str):
        return set(flags)
    found = set()
    for line in flags.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            found.update(value.split())
    return found if found or ":" in flags else set(flags.split())


def native_bf16(flags: set[str] | str | None = None, isa_cap: str | None = None) -> str | None:
    """What runs bf16 matmuls natively on this CPU ("AMX", "AVX512-BF16", "Arm BF16"), or None: emulated.

    `flags`: a set of cpuinfo flags, a `flags`/`Features` line or a whole /proc/cpuinfo (default: this machine's).
    `isa_cap`: oneDNN's ONEDNN_MAX_CPU_ISA (default: the environment's); a cap below the level an x86 unit needs
    (e.g. AVX2 or AVX512_CORE) makes it not native, since oneDNN, which runs torch's bf16 matmuls, will not use it.
    """
    have = _cpu_flags(flags)
    if isa_cap is None:
        isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    cap = _ONEDNN_ISA.get(isa_cap.strip().upper())  # ALL, DEFAULT or a level this table does not know: no cap
    for flag, name, level in _BF16_UNITS:
        if flag in have and (level is None or cap is None or cap >= _ONEDNN_ISA[level]):
            return name
    return None


def _gflops(rate: float) -> str:
    """3 significant digits below 100 GFLOP/s, whole numbers above (never 1e+03)."""
    g = rate / 1e9
    return f"{g:,.0f} GFLOP/s" if g >= 100 else f"{g:.3g} GFLOP/s"


def auto_mode(kind: str, capability: float = 0.0, rates: dict | None = None) -> tuple[str, str]:
    """precision.mode=auto's one rule, for `kiln train` (resolve_mode) and the planner (precision_for): (mode, why).

    CUDA: bf16 from compute capability 8.0 (Ampere) on, fp32 before. CPU: bf16 when the measured bf16 matmul rate
    (`rates`: {"fp32": FLOP/s, "bf16": FLOP/s}) is at least BF16_CPU_MIN_SPEEDUP x fp32's, else fp32.
    """
    if kind == "cuda":
        if capability >= 8.0:
            return "bf16", f"compute capability {capability:g} runs bf16 on tensor cores"
        return "fp32", f"compute capability {capability:g} < 8.0 has no bf16 tensor cores"
    if kind == "cpu":
        fp32, bf16 = rates["fp32"], rates.get("bf16", 0.0)
        mode = "bf16" if bf16 >= BF16_CPU_MIN_SPEEDUP * fp32 else "fp32"
        return mode, (f"bf16 matmul {_gflops(bf16)} vs fp32 {_gflops(fp32)} on this CPU (auto takes bf16 from "
                      f"{BF16_CPU_MIN_SPEEDUP:g}x fp32's rate)")
    return "fp32", f"kiln knows no faster precision on {kind}"


def _cpu_rates(*precisions: str) -> dict[str, float]:
    """The square-matmul rates auto and the notice compare: measured once per machine, then read back."""
    return {p: stored_cpu_peak(p) for p in precisions}


def resolve_mode(mode: str, device: torch.device) -> str:
    """The concrete precision for `mode` on `device`; explicit modes the device cannot run are errors.

    Every CPU runs bf16, bf16-master and fp16 (emulated where it lacks the instructions; see precision_notice).
    """
    return decide_mode(mode, device)[0]


def decide_mode(mode: str, device: torch.device) -> tuple[str, str]:
    """(the concrete precision for `mode` on `device`, what decided it): auto's measurement or rule, or the
    configured mode itself. `kiln train` records both in the run's config, so a resume runs the same precision."""
    if is_auto(mode):
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            chosen, why = auto_mode("cuda", float(f"{major}.{minor}"))
        elif device.type == "cpu":
            chosen, why = auto_mode("cpu", rates=_cpu_rates("fp32", "bf16"))
        else:
            chosen, why = auto_mode(device.type)
        return chosen, f"precision.mode=auto on {device.type}: {why}"
    return _checked(mode, device), f"precision.mode={mode} as configured"


def _checked(mode: str, device: torch.device) -> str:
    if PRECISIONS[mode].tf32 and device.type != "cuda":
        raise KilnError("precision.mode='tf32' needs a CUDA device; use fp32 or bf16 on CPU", key="precision.mode",
                        value=mode, fix="use fp32 or bf16 on CPU")
    if PRECISIONS[mode].fp8:
        capability = 0.0
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            capability = float(f"{major}.{minor}")
        why = fp8_refusal(device.type, capability)
        if why:
            raise KilnError(why, key="precision.mode", value=mode, fix="use bf16")
    return mode


FP8_MIN_CAPABILITY = 8.9  # Ada and Hopper have fp8 tensor cores


def fp8_refusal(kind: str, capability: float, name: str = "this GPU") -> str | None:
    """Why precision.mode=fp8 cannot run on this device, or None when it can (CUDA, compute capability ≥ 8.9)."""
    if kind != "cuda":
        return (f"precision.mode='fp8' needs a CUDA GPU with fp8 tensor cores (compute capability ≥ 8.9: Ada, "
                f"Hopper); this run is on {kind}: use bf16")
    if capability < FP8_MIN_CAPABILITY:
        return (f"precision.mode='fp8' needs compute capability ≥ 8.9 (Ada, Hopper); {name} is {capability:.1f}: "
                f"use bf16")
    return None


def precision_notice(requested: str, device: torch.device) -> str | None:
    """One line for the run's console about the precision on a CPU, or None: why auto chose what it did, or that
    bf16/fp16 is emulated or slower than fp32 here. `kiln train` prints it once at start-up."""
    if device.type != "cpu":
        return None
    mode = resolve_mode(requested, device)
    if is_auto(requested):
        return f"precision auto → {mode}: {auto_mode('cpu', rates=_cpu_rates('fp32', 'bf16'))[1]}"
    half = PRECISIONS[mode].half  # the half-precision matmuls' peak key: "bf16" or "fp16"; "" for fp32, fp64
    if not half:
        return None
    bf16 = PRECISIONS[mode].cpu_matmul == torch.bfloat16
    rates = _cpu_rates("fp32", half)
    ratio = rates["fp32"] / rates[half]
    speed = (f"{half} matmul {_gflops(rates[half])} vs fp32 {_gflops(rates['fp32'])}"
             + (f", {ratio:.3g}x slower than fp32" if ratio > 1 else ""))
    unit = native_bf16() if bf16 else None
    if bf16 and unit is None:
        return (f"precision {mode}: bf16 is emulated on this CPU (no AMX, AVX512-BF16 or Arm BF16 that oneDNN "
                f"uses): {speed}" + ("; --precision.mode=fp32 trains faster here" if ratio > 1 else ""))
    if ratio > 1:
        native = f" runs natively ({unit}) but" if unit else ""
        return f"precision {mode}: {half} on this CPU{native} is slower than fp32: {speed}"
    return None


# ---------------------------------------------------------------- Triton kernels

KERNEL_BACKENDS = ("torch", "triton", "auto")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_env() -> bool:
    """TRITON_INTERPRET as Triton reads it: kernels run through its numpy interpreter on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


# The GPUs the kernels' launch configurations are checked for (sm_80, sm_89 and sm_90's shared memory, by
# tests/kernels/test_kernels_gpu_launches.py). Older cards have less shared memory per block than some launches
# need: 16-bit flash attention at head dim 128 takes 128 KiB in its backward, a V100 block gets 96 KiB.
MIN_CAPABILITY = (8, 0)


def _capability_ok(device: torch.device) -> tuple[bool, tuple[int, int] | None]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return True, None  # resolving for a GPU this process does not see (planning, tests): assume a new one
    capability = torch.cuda.get_device_capability(device)
    return capability >= MIN_CAPABILITY, capability


def resolve_kernels(kernels: str, device: torch.device | str) -> str:
    """"torch" or "triton" for train.kernels on `device`; a ValueError (a setting this machine cannot run: the CLI's
    one line) explains the fix when Triton cannot run there."""
    device = torch.device(device)
    if kernels not in KERNEL_BACKENDS:
        raise KilnError(f"train.kernels={kernels!r} is unknown; use one of {KERNEL_BACKENDS}",
                        key="train.kernels", value=kernels, fix=f"use one of {KERNEL_BACKENDS}")
    if kernels == "torch":
        return "torch"
    supported, capability = _capability_ok(device)
    if kernels == "auto":
        return "triton" if device.type == "cuda" and supported and triton_available() else "torch"
    if not triton_available():
        raise KilnError("train.kernels='triton' needs the triton package: pip install 'kiln[triton]' "
                        "(or use train.kernels='auto', which falls back to torch)",
                        key="train.kernels", value=kernels, fix="pip install 'kiln[triton]'")
    if not supported:
        raise KilnError(f"train.kernels='triton' needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                        f"or newer (Ampere and later GPUs); this GPU is "
                        f"{capability[0]}.{capability[1]}: use train.kernels='torch' or 'auto'",
                        key="train.kernels", value=kernels, fix="use train.kernels='torch' or 'auto'")
    if device.type in ("cuda", "meta"):
        return "triton"
    if device.type == "cpu" and interpret_env():
        return "triton"  # Triton's interpreter: numpy on the CPU, for tests (slow)
    raise KilnError(f"train.kernels='triton' runs on CUDA; on {device.type} only through Triton's interpreter: "
                    f"set TRITON_INTERPRET=1 in the environment before starting (slow, meant for tests), or "
                    f"use train.kernels='auto' or 'torch'",
                    key="train.kernels", value=kernels, fix="use train.kernels='auto' or 'torch'")
