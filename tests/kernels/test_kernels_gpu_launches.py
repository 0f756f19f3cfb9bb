"""The launch configurations a GPU gets, checked on a machine without one.

The interpreter tests run the kernels with the interpreter's small tiles. Here `gpu_tiles` is forced on, so CPU
tensors get the GPU's tile sizes, warps and pipeline stages, and two things are checked:

- compiled: each op runs forward and backward at LLM widths in fp32 (IEEE and TF32 dots), bf16 and fp16 while the
  interpreter records each launch instead of running it; a fresh process without TRITON_INTERPRET compiles every
  distinct launch to a cubin with ptxas for sm_90 (H100, H200), and the launches of the tl.dot kernels, whose
  shared memory grows with their tiles, also for sm_80 (A100). Each must compile, and the shared memory it needs
  must fit every architecture that runs the same code: sm_80's build is also sm_89's (L4, RTX 4090: the same
  mma.sync tensor-core code, less shared memory), and a dot in fp32 with IEEE precision uses no tensor cores
  (FMA code, the same on every architecture), so its sm_90 build is checked against the smallest limit of all.
- computed: the interpreter runs each op with the GPU's tiles at shapes that leave partial tiles, in fp32 against
  the fp64 references and in fp16 against torch's fp16 (the criterion of the CUDA tests).

On a GPU this file skips: there the CUDA tests compile and run the same kernels.
"""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln.kernels as ops
from kiln.kernels.cross_entropy import cross_entropy_reference
from kiln.kernels.flash_attention import flash_attention_reference
from kiln.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_reference
from kiln.kernels.gelu import gelu_reference
from kiln.kernels.layer_norm import layer_norm_reference
from kiln.kernels.linear import linear_reference
from kiln.kernels.rms_norm import rms_norm_reference
from kiln.kernels.rope import rope_reference
from kiln.kernels.swiglu import swiglu_reference
from kiln.kernels.utils import interpret_env
from kiln.models.transformer import rope_cache
from tests.kernels.conftest import assert_within_twice_torch_error, compare_with_reference, targets
from tests.kernels.test_kernels_fp16 import CASES as FP16_CASES

pytestmark = pytest.mark.skipif(not interpret_env(), reason="on a GPU the CUDA tests compile and run the kernels")

REPO = Path(__file__).resolve().parents[2]
# Largest shared memory one block may use (the opt-in maximum), bytes, from NVIDIA's CUDA programming guide.
SHARED_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DOT_KERNELS = {"_matmul_kernel", "_flash_attention_fwd_kernel", "_flash_attention_bwd_dkdv_kernel",
               "_flash_attention_bwd_dq_kernel"}


@pytest.fixture
def gpu_tiles_on(monkeypatch):
    """Launch configurations for a GPU on CPU tensors."""
    for name, module in list(sys.modules.items()):
        if name.startswith("kiln.kernels") and hasattr(module, "gpu_tiles"):
            monkeypatch.setattr(module, "gpu_tiles", lambda device: True)


@pytest.fixture
def gpu_launches(gpu_tiles_on, monkeypatch):
    """Record the launches the ops make, with GPU tile sizes, instead of running them: {key: launch}."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import mangle_type

    launches = {}

    def record(self, *args, grid, warmup, **kwargs):
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
        params = inspect.signature(self.fn).parameters.values()
        values = dict(zip([p.name for p in params], args)) | kwargs
        signature, constexprs = {}, {}
        for p in params:
            kind = "constexpr" if "constexpr" in str(p.annotation) else mangle_type(values[p.name])
            signature[p.name] = kind
            if kind == "constexpr":
                constexprs[p.name] = values[p.name]
        launch = dict(module=self.fn.__module__, kernel=self.fn.__name__, signature=signature,
                      constexprs=constexprs, options=options)
        launches[json.dumps(launch, sort_keys=True)] = launch

    # every launch is `kernel[grid](...)` (no autotuner): patching the subscript works on every Triton since 3.0,
    # where InterpretedFunction.run is an instance attribute (≤ 3.5) or a method (3.6 on)
    monkeypatch.setattr(InterpretedFunction, "__getitem__",
                        lambda self, grid: lambda *args, **kwargs: record(self, *args, grid=grid, warmup=False,
                                                                          **kwargs))
    return launches


def _forward_backward(fn, *inputs):
    leaves = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    fn(*leaves).float().sum().backward()


def _run_ops(dtype: torch.dtype) -> None:
    """Each op forward and backward at the widths of GPT-2 and Llama models (few tokens: the kernels are only
    recorded, and their tile sizes depend on the widths)."""
    def rand(*shape):
        return torch.randn(*shape, dtype=dtype)

    for width in (768, 1000, 4096, 8192):
        _forward_backward(ops.layer_norm, rand(4, width), rand(width), rand(width))
        _forward_backward(lambda x, w: ops.layer_norm(x, w, None), rand(4, width), rand(width))
        _forward_backward(ops.rms_norm, rand(4, width), rand(width))
    _forward_backward(ops.gelu, rand(4, 3072))
    _forward_backward(ops.swiglu, rand(4, 11008), rand(4, 11008))
    _forward_backward(ops.linear, rand(64, 768), rand(3072, 768), rand(3072))
    _forward_backward(ops.linear, rand(64, 768), rand(3072, 768))
    for vocab in (50257, 128256):
        _forward_backward(ops.cross_entropy, rand(4, vocab), targets(4, vocab))
        _forward_backward(lambda x, t: ops.cross_entropy(x, t, label_smoothing=0.1), rand(4, vocab),
                          targets(4, vocab))
    _forward_backward(ops.fused_linear_cross_entropy, rand(8, 768), rand(50257, 768), targets(8, 50257))
    for head_dim in (64, 80, 128):
        cos, sin = rope_cache(head_dim, 16, 10000.0)
        _forward_backward(lambda x: ops.rope(x, cos, sin), rand(1, 4, 16, head_dim))
        for causal in (True, False):
            _forward_backward(lambda q, k, v: ops.flash_attention(q, k, v, causal=causal),
                              rand(1, 4, 128, head_dim), rand(1, 2, 128, head_dim), rand(1, 2, 128, head_dim))


def _all_kernels() -> set[str]:
    return {value.__name__ for name, module in list(sys.modules.items()) if name.startswith("kiln.kernels.")
            for value in vars(module).values()
            if type(value).__name__ == "InterpretedFunction" and value.__name__.endswith("_kernel")}


def _fma_dot(launch: dict) -> bool:
    """A tl.dot kernel launched on fp32 data with IEEE precision: FMA code, no tensor cores."""
    return (launch["kernel"] in DOT_KERNELS and launch["constexprs"].get("DOT_PRECISION") == "ieee"
            and not {"*bf16", "*fp16"} & set(launch["signature"].values()))


def _limit(result: dict) -> int:
    """The shared memory a compiled launch must fit: its own architecture's and every other that runs its code
    (sm_80's build runs on sm_89; an FMA dot's sm_90 build stands for all three)."""
    if result["kernel"] in DOT_KERNELS and result["arch"] == 90 and _fma_dot(result):
        return min(SHARED_LIMIT.values())
    if result["arch"] == 80:
        return min(SHARED_LIMIT[80], SHARED_LIMIT[89])
    return SHARED_LIMIT[result["arch"]]


def _compile(jobs: list[dict], tmp_path: Path) -> list[dict]:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(jobs))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "tests.kernels.compile_launches", str(path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# 34-110 s of ptxas on 2 CPU cores: a check of what a GPU will compile, so `make gpu-preflight` runs it before a GPU
# window and `make test` leaves it out (docs/testing.md); the GPU-tile computations below stay in `make test`.
@pytest.mark.gpu_preflight
def test_every_gpu_launch_compiles_for_sm80_sm89_sm90(gpu_launches, tmp_path):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for allow in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = allow
            _run_ops(torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    _run_ops(torch.bfloat16)
    _run_ops(torch.float16)
    launches = list(gpu_launches.values())
    assert {launch["kernel"] for launch in launches} == _all_kernels()
    matmul_tiles = {launch["constexprs"]["BLOCK_M"] for launch in launches if launch["kernel"] == "_matmul_kernel"}
    assert matmul_tiles == {64, 128}, f"GPU tiles not in use: {matmul_tiles}"  # fp32 and 16-bit tiles
    assert any(launch["constexprs"].get("DOT_PRECISION") == "tf32" for launch in launches)

    # sm_90 compiles everything. sm_80 differs from it in the tensor-core code of tl.dot and in shared memory: the
    # dot kernels on tensor cores, causal only and bf16 for the 16-bit types (fp16 tiles take the same bytes).
    # An fp32 IEEE dot (FMA code, ~4x the compile time of the others) is compiled once, for sm_90, causal only: the
    # non-causal kernel is the causal one without its mask (a constexpr branch), on the same tiles.
    jobs = [launch | {"arch": 90} for launch in launches
            if not (_fma_dot(launch) and launch["constexprs"].get("CAUSAL") is False)]
    jobs += [launch | {"arch": 80} for launch in launches
             if launch["kernel"] in DOT_KERNELS and launch["constexprs"].get("CAUSAL", True)
             and "*fp16" not in launch["signature"].values() and not _fma_dot(launch)]
    results = _compile(jobs, tmp_path)
    assert len(results) == len(jobs)
    failed = [f"sm_{r['arch']} {r['kernel']} {r['constexprs']} {r['signature']}: {r['error'][:400]}"
              for r in results if "error" in r]
    assert not failed, "\n".join(failed[:5]) + f"\n({len(failed)} of {len(results)} failed)"
    too_big = [f"sm_{r['arch']} {r['kernel']} {r['constexprs']} {r['options']}: {r['shared']} bytes of shared "
               f"memory > {_limit(r)} (the smallest of the architectures running this code)"
               for r in results if r["shared"] > _limit(r)]
    assert not too_big, "\n".join(too_big)
    assert all(r["cubin_bytes"] > 0 for r in results)


# The GPU's tiles are larger than the interpreter's (up to 128x128 matmul tiles, 4096-wide vocabulary blocks,
# 32x32 or 64x64 attention tiles): the same ops at shapes that leave partial GPU tiles, run by the interpreter with
# the GPU's launch configurations, against the fp64 references.
COS, SIN = rope_cache(64, 45, 10000.0)
GPU_TILE_CASES = {  # name -> (inputs, kernel, fp64 reference)
    "layer_norm": (lambda: [torch.randn(5, 1000) * 2 + 1, torch.randn(1000), torch.randn(1000)], ops.layer_norm,
                   layer_norm_reference),
    "rms_norm": (lambda: [torch.randn(5, 1000) * 2, torch.randn(1000)], ops.rms_norm, rms_norm_reference),
    "gelu": (lambda: [torch.randn(3, 2100) * 3], ops.gelu, gelu_reference),
    "swiglu": (lambda: [torch.randn(3, 2100) * 2, torch.randn(3, 2100)], ops.swiglu, swiglu_reference),
    "linear": (lambda: [torch.randn(130, 70), torch.randn(200, 70) * 0.1, torch.randn(200)], ops.linear,
               linear_reference),
    "cross_entropy": (lambda: [torch.randn(5, 5000) * 3, targets(5, 5000)], ops.cross_entropy,
                      cross_entropy_reference),
    "fused_linear_cross_entropy": (lambda: [torch.randn(20, 32), torch.randn(5000, 32) * 0.3, targets(20, 5000)],
                                   ops.fused_linear_cross_entropy, fused_linear_cross_entropy_reference),
    "rope": (lambda: [torch.randn(1, 2, 45, 64)], lambda x: ops.rope(x, COS, SIN),
             lambda x: rope_reference(x, COS.double(), SIN.double())),
    "flash_attention_d64": (lambda: [torch.randn(1, 2, 100, 64), torch.randn(1, 1, 100, 64),
                                     torch.randn(1, 1, 100, 64)], ops.flash_attention, flash_attention_reference),
    "flash_attention_d128": (lambda: [torch.randn(1, 2, 100, 128) for _ in range(3)], ops.flash_attention,
                             flash_attention_reference),
}


@pytest.mark.parametrize("name", GPU_TILE_CASES)
def test_gpu_tiles_compute_the_same(name, gpu_tiles_on):
    torch.manual_seed(0)
    make, kernel, reference = GPU_TILE_CASES[name]
    compare_with_reference(kernel, reference, make(), what=f"{name} with GPU tiles")


@pytest.mark.parametrize("name", FP16_CASES)
def test_gpu_tiles_fp16_within_twice_torch_error(name, gpu_tiles_on):
    torch.manual_seed(0)
    make, kernel_fn, torch_fn = FP16_CASES[name]
    assert_within_twice_torch_error(name, kernel_fn, torch_fn, make(), torch.float16)
