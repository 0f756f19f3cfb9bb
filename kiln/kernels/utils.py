"""Launch helpers shared by the Triton kernels: where they may run, block sizes, autocast casts.

Imports no Triton. Whether Triton is wanted at all is kiln.perf.hardware.resolve_kernels.
"""
from __future__ import annotations

import torch

from kiln.errors import KilnError
from kiln.perf.hardware import interpret_env


def check_device(*tensors: torch.Tensor | None, kernel=None) -> None:
    """Fail with the fix spelled out instead of Triton's error about a CPU pointer.

    `kernel` (a @triton.jit function of the op) tells whether the interpreter really is in use: Triton 3.9 picks
    interpreter or compiler when the decorator runs, at the op module's import, so TRITON_INTERPRET set later
    changes nothing for kernels already defined.
    """
    tensors = [t for t in tensors if t is not None]
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise KilnError(f"kiln.kernels: all tensors must be on one device, got {device} and {t.device}",
                            key="device", value=str(t.device), fix=f"move every tensor to {device}")
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpret_env():
        if kernel is not None and type(kernel).__name__ != "InterpretedFunction":
            raise RuntimeError("TRITON_INTERPRET=1 was set after the kiln.kernels op modules were imported; Triton "
                               "reads it when kernels are defined, so set it before the first import "
                               "(tests/kernels/conftest.py does)")
        return
    raise KilnError(f"kiln.kernels run on CUDA tensors, or on CPU tensors through Triton's interpreter when "
                    f"TRITON_INTERPRET=1 is set before import; got a {device.type} tensor: use "
                    f"train.kernels='torch' (or 'auto') on this device",
                    key="train.kernels", value="triton", fix="use train.kernels='torch' (or 'auto') on this device")


def gpu_tiles(device: torch.device) -> bool:
    """Whether launches for tensors on `device` take the GPU's tile sizes and warps (else the interpreter's).

    True on CUDA. tests/kernels/test_kernels_gpu_launches.py also makes it true for CPU tensors: it records the
    launches a GPU would get and compiles them for GPU targets on a machine without one.
    """
    return device.type == "cuda"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_tile(n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for kernels that hold BLOCK_M whole rows of n elements (masked beyond n)."""
    block_n = next_power_of_2(n)
    if block_n > 65536:
        # Beyond 64k fp32 values a row no longer fits the registers of one program.
        raise KilnError(f"kiln.kernels: rows of {n} elements exceed the 65536 a row kernel holds",
                        key="model.d_model", value=n, fix="use train.kernels='torch' for rows this wide")
    if gpu_tiles(device):
        # Tiles of at least 2048 elements: one row per program from hidden 2048 up, several rows below it so a
        # program still moves enough bytes to hide its launch; one warp per 256 elements (8 fp32 per thread).
        block_m = max(1, 2048 // block_n)
        return block_m, block_n, min(max(block_m * block_n // 256, 1), 16)
    # The interpreter pays a fixed Python cost per program and per op, nearly whatever the tile size:
    # 4096-element tiles (64 rows at hidden 64) ran the 128x64 LayerNorm forward in 6 ms, against 185 ms with
    # one row per program.
    return max(1, 4096 // block_n), block_n, 1


def elementwise_tile(n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for elementwise kernels over (rows, n) with a row stride."""
    # 2048-element tiles with 4 warps: 16 values per thread, enough bytes in flight per program for a
    # bandwidth-bound op (not tuned); on the interpreter 4096 (fewer programs, same per-op cost).
    tile = 2048 if gpu_tiles(device) else 4096
    block_n = min(next_power_of_2(n), tile)
    return tile // block_n, block_n, 4


def partial_programs(rows: int, device: torch.device) -> int:
    """Programs that each reduce a slice of rows into one partial sum (weight gradients of the norms)."""
    if device.type == "cuda":
        # One per SM fills the GPU once; more programs only make the second-pass reduction longer.
        return min(rows, torch.cuda.get_device_properties(device).multi_processor_count)
    return min(rows, 4)  # the interpreter runs programs one after another: few and long is fastest


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 tl.dot in IEEE unless torch itself allows TF32 matmuls; ignored for bf16/fp16."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype an enclosing torch.autocast would run matmul-like ops in, or None when off."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., N) as a (rows, N) view when strides allow, with unit stride along N."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
