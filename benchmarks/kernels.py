"""kiln's Triton kernels against eager PyTorch and torch.compile: forward+backward time and peak memory.

GPU only. Shapes are LLM-sized (hidden 768-8192, tokens 4k-32k, vocabulary 32k-128k), inputs bf16. For each op
and shape it times forward+backward (median of CUDA-event-timed repeats after warm-up) and the peak memory
allocated above the inputs, for the kernel, eager PyTorch and torch.compile of the eager function; the norms
also report their bandwidth as a fraction of a device-to-device copy's. Targets (H100): norms ≥ 3x eager and
≥ 80% of copy bandwidth; fused linear cross-entropy ≤ 1/5 of eager's peak memory and no slower at vocabulary
50257 and 128256; flash attention within 1.3x of SDPA's flash backend.

    .venv/bin/python benchmarks/kernels.py [--quick] [--ops rms_norm,flash_attention] [--no-compile] [--no-write]

Writes the table, with device and date, under "## Kernels" in docs/benchmarks.md (other sections untouched).
"""
from __future__ import annotations

import argparse
import datetime
import re
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DTYPE = torch.bfloat16


def bench(fn, inputs_fn, repeats: int = 20, warmup: int = 3):
    """(median ms, peak MiB above the inputs) of fn(*inputs) including backward; None, None on OOM."""
    try:
        inputs = inputs_fn()
        for _ in range(warmup):
            fn(*inputs)
        for t in inputs:  # gradients of the warm-up count as the step's memory, not the inputs'
            if isinstance(t, torch.Tensor):
                t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*inputs)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*inputs)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), peak
    except torch.OutOfMemoryError:
        return None, None
    finally:
        inputs = None
        torch.cuda.empty_cache()


def fwd_bwd(forward):
    """A step: forward, then backward of a fixed upstream gradient (1 for scalars), grads cleared first."""

    def step(*inputs):
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.grad is not None:
                t.grad = None
        out = forward(*inputs)
        out.backward(torch.ones_like(out))

    return step


def leaf(*shape, scale=1.0, dtype=DTYPE):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype).requires_grad_()


def targets(n, vocab):
    return torch.randint(0, vocab, (n,), device="cuda")


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = bench(lambda: dst.copy_(src), lambda: (), repeats=10)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def cases(quick: bool):
    """(op, shape label, inputs_fn, kernel fwd, eager fwd, bytes moved by fwd+bwd or None)."""
    import kiln.kernels as ops
    from kiln.models.transformer import Rotary, rope_cache

    tokens = [4096] if quick else [4096, 16384]
    for hidden in ([768, 4096] if quick else [768, 4096, 8192]):
        for M in tokens:
            # fwd reads x and writes y; bwd reads x and dy and writes dx: 5 activations of traffic (weights are
            # negligible).
            nbytes = 5 * M * hidden * 2
            yield ("layer_norm", f"{M}x{hidden}", lambda M=M, h=hidden: (leaf(M, h), leaf(h), leaf(h)),
                   ops.layer_norm, lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), nbytes)
            yield ("rms_norm", f"{M}x{hidden}", lambda M=M, h=hidden: (leaf(M, h), leaf(h)), ops.rms_norm,
                   lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), nbytes)
    M = 8192
    yield ("gelu", f"{M}x3072", lambda: (leaf(M, 3072),), ops.gelu, lambda x: F.gelu(x, approximate="tanh"), None)
    yield ("swiglu", f"{M}x11008", lambda: (leaf(M, 2 * 11008),), lambda h: ops.swiglu(*h.chunk(2, -1)),
           lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1], None)
    cos, sin = rope_cache(128, 4096, 10000.0, device="cuda")
    yield ("rope", "4x32x4096x128", lambda: (leaf(4, 32, 4096, 128),), lambda x: ops.rope(x, cos, sin),
           lambda x: Rotary()(x, cos, sin), None)
    yield ("linear", f"{M}x4096->4096", lambda: (leaf(M, 4096), leaf(4096, 4096, scale=0.02)), ops.linear,
           F.linear, None)
    for vocab in (32000, 128256):
        yield ("cross_entropy", f"{M}x{vocab}", lambda v=vocab: (leaf(M, v), targets(M, v)), ops.cross_entropy,
               lambda x, t: F.cross_entropy(x.float(), t), None)
    for M, hidden, vocab in ([(4096, 768, 50257)] if quick else
                             [(8192, 768, 50257), (16384, 2048, 128256), (32768, 4096, 128256)]):
        yield ("fused_linear_cross_entropy", f"{M}x{hidden}, V={vocab}",
               lambda M=M, h=hidden, v=vocab: (leaf(M, h), leaf(v, h, scale=0.02), targets(M, v)),
               ops.fused_linear_cross_entropy, lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t), None)
    for T, D in ([(4096, 128)] if quick else [(4096, 64), (4096, 128), (16384, 128)]):
        B, H = max(1, 16384 // T), 16
        yield ("flash_attention", f"{B}x{H}x{T}x{D}", lambda B=B, T=T, D=D: tuple(leaf(B, H, T, D) for _ in range(3)),
               ops.flash_attention, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), None)


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def fmt(x, digits=2):
    return "OOM" if x is None else f"{x:.{digits}f}"


def run(args) -> list[str]:
    torch.backends.cuda.matmul.allow_tf32 = True
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    rows = []
    wanted = set(args.ops.split(",")) if args.ops else None
    for op, shape, inputs_fn, kernel, eager, nbytes in cases(args.quick):
        if wanted and op not in wanted:
            continue
        ours_ms, ours_mb = bench(fwd_bwd(kernel), inputs_fn)
        eager_ms, eager_mb = bench(fwd_bwd(eager), inputs_fn)
        comp_ms = comp_mb = None
        if not args.no_compile:
            comp_ms, comp_mb = bench(fwd_bwd(torch.compile(eager, dynamic=False)), inputs_fn)
        notes = []
        if nbytes and ours_ms:
            notes.append(f"{nbytes / (ours_ms * 1e-3) / 1e9 / copy_gbs:.0%} of copy bandwidth")
        if op == "flash_attention":
            sdpa_ms, _ = bench(fwd_bwd(sdpa_flash), inputs_fn)
            if sdpa_ms and ours_ms:
                notes.append(f"{ours_ms / sdpa_ms:.2f}x SDPA-flash time ({sdpa_ms:.2f} ms)")
        if op == "fused_linear_cross_entropy" and ours_mb and eager_mb:
            notes.append(f"{ours_mb / eager_mb:.2f}x eager peak memory")
        speedup = f"{eager_ms / ours_ms:.2f}x" if ours_ms and eager_ms else "-"
        row = (f"| {op} | {shape} | {fmt(ours_ms)} | {fmt(eager_ms)} | {fmt(comp_ms)} | {speedup} | "
               f"{fmt(ours_mb, 0)} | {fmt(eager_mb, 0)} | {fmt(comp_mb, 0)} | {'; '.join(notes)} |")
        print(row, flush=True)
        rows.append(row)
    return rows


TARGETS = ("Targets on an H100: norms fwd+bwd ≥ 3× eager and ≥ 80% of copy bandwidth; fused linear cross-entropy "
           "≤ 1/5 of eager's peak memory and no slower than eager at vocabulary 50257 and 128256; flash attention "
           "within 1.3× of SDPA's flash backend.")
HEADER = ("| op | shape | triton ms | eager ms | compile ms | vs eager | triton MiB | eager MiB | compile MiB | "
          "notes |\n|---|---|---|---|---|---|---|---|---|---|")


def write_section(rows: list[str], device: str) -> None:
    import triton

    stamp = datetime.date.today().isoformat()
    body = (f"## Kernels\n\n`benchmarks/kernels.py`, {stamp}, {device}, torch {torch.__version__}, triton "
            f"{triton.__version__}, bf16 inputs, forward+backward, median of 20. Peak memory is allocated above the "
            f"inputs. Command: `.venv/bin/python benchmarks/kernels.py`.\n\n{TARGETS}\n\n{HEADER}\n"
            + "\n".join(rows) + "\n")
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    pattern = re.compile(r"^## Kernels\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: body + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + body
    DOC.write_text(text)
    print(f"wrote the Kernels section of {DOC}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one or two shapes per op")
    parser.add_argument("--ops", default="", help="comma-separated ops to run (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU (the kernels' timings and memory are GPU numbers); "
                 "torch sees none here. The CPU interpreter (TRITON_INTERPRET=1) is for correctness tests only.")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/kernels.py needs Triton: pip install 'kiln[triton]'")
    device = torch.cuda.get_device_name()
    rows = run(args)
    if not args.no_write:
        write_section(rows, device)


if __name__ == "__main__":
    main()
