"""Causal attention's forward and backward on a CPU, at a step's shape (the tiny preset: batch 8, 6 heads, 256
positions, head dim 64): where a bf16 step's attention time goes, and whether a backward of our own would win.

Timed side by side in one process, per dtype (thread CPU time, medians of --repeats calls after 3 warm-up calls):
    flash        torch's fused CPU kernel (SDPA's flash backend), forward alone and forward + backward
    math         SDPA's math backend (the products and the softmax as separate operators)
    bmm-bwd      torch's flash forward (output and log-sum-exp), then a backward of separate operators: the five
                 products as batched matmuls in the inputs' dtype (oneDNN's AMX kernels in bf16; no bf16 matmul on
                 a CPU writes fp32, so the scores S and dP are rounded to bf16), the softmax's elementwise work in
                 fp32, heads in chunks of --chunk, query rows in blocks of --block (blocks above the diagonal skipped)
glibc malloc is tuned as a kiln CPU run tunes it (kiln.perf.allocator). Each backward's gradients are compared with a float64 reference (relative Frobenius error of dq, dk, dv).

    PYTHONPATH=. python benchmarks/cpu_attention.py [--threads 1] [--repeats 20] [--chunk 48] [--block 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kiln.perf.allocator import tune
from kiln.perf.measured import cpu_model

B, H, T, D = 8, 6, 256, 64


def timed(fn, repeats: int) -> float:
    """Median thread CPU milliseconds of fn() over `repeats` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def bmm_backward(q, k, v, out, lse, dout, chunk: int, block: int):
    """dq, dk, dv of causal softmax(q·kᵀ/√D)·v from the forward's output and log-sum-exp (FlashAttention's
    backward as separate torch operators); dk and dv accumulate over query blocks in fp32."""
    scale = D ** -0.5
    q, k, v, out, dout = (x.reshape(-1, T, D) for x in (q, k, v, out, dout))
    n = q.shape[0]
    neg_lse = lse.reshape(n, T, 1).neg()
    delta = (dout.float() * out.float()).sum(-1, keepdim=True).mul_(-scale)  # -scale · rowsum(dO ∘ O)
    dq = torch.empty_like(q)
    dk, dv = torch.zeros(n, T, D), torch.zeros(n, T, D)
    above = torch.full((block, block), float("-inf")).triu(1)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        for r0 in range(0, T, block):
            r1 = min(T, r0 + block)
            qs, dos, ks, vs = q[s:e, r0:r1], dout[s:e, r0:r1], k[s:e, :r1], v[s:e, :r1]
            p = torch.add(neg_lse[s:e, r0:r1], torch.bmm(qs, ks.transpose(1, 2)), alpha=scale)
            p[:, :, r0:r1].add_(above[:r1 - r0, :r1 - r0])
            p.exp_()
            dv[s:e, :r1] += torch.bmm(p.to(q.dtype).transpose(1, 2), dos)
            ds = torch.add(delta[s:e, r0:r1], torch.bmm(dos, vs.transpose(1, 2)), alpha=scale).mul_(p).to(q.dtype)
            dq[s:e, r0:r1] = torch.bmm(ds, ks)
            dk[s:e, :r1] += torch.bmm(ds.transpose(1, 2), qs)
    return [x.view(B, H, T, D).to(q.dtype) for x in (dq, dk, dv)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=48)
    ap.add_argument("--block", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tuned = tune()  # glibc malloc as a kiln CPU run sets it (train.cpu_allocator=auto)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    print(f"CPU: {cpu_model()} | {args.threads} thread(s) | torch {torch.__version__} | ISA "
          f"{torch.backends.cpu.get_cpu_capability()} | malloc {'tuned' if tuned else 'as is'} | shape B={B} H={H} T={T} D={D}, causal")
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, T, D, dtype=dtype, generator=gen) for _ in range(4))
        ref = [x.double().requires_grad_() for x in (q, k, v)]
        F.scaled_dot_product_attention(*ref, is_causal=True).backward(dout.double())

        def error(grads) -> str:
            return " ".join(f"{((g.double() - r.grad).norm() / r.grad.norm()).item():.2e}" for g, r in zip(grads, ref))

        def sdpa(backend):
            def run():
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
                return [x.grad for x in leaves]
            return run

        out, lse = flash(q, k, v, 0.0, True)[:2]
        name = str(dtype).removeprefix("torch.")
        fwd = timed(lambda: flash(q, k, v, 0.0, True), args.repeats)
        print(f"{name}: flash forward {fwd:.1f} ms")
        for label, run in (("flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("math", sdpa(SDPBackend.MATH))):
            total = timed(run, args.repeats)
            print(f"  {label:8} forward + backward {total:6.1f} ms (backward ~{total - fwd:5.1f})"
                  f" | error dq dk dv {error(run())}")
        bwd = timed(lambda: bmm_backward(q, k, v, out, lse, dout, args.chunk, args.block), args.repeats)
        print(f"  bmm-bwd  flash forward + own backward {fwd + bwd:6.1f} ms (backward {bwd:5.1f})"
              f" | error dq dk dv {error(bmm_backward(q, k, v, out, lse, dout, args.chunk, args.block))}")


if __name__ == "__main__":
    main()
