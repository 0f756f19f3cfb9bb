"""Cost of the document mask (data.document_mask) on this machine: attention, and a whole training step.

Packed windows attend only inside their documents (kiln.models.documents). Three ways to compute that attention
are timed against plain causal attention (SDPA, is_causal=True), forward and backward, in one process, taking
turns one repetition at a time so that machine noise lands on every variant alike; the median of the paired
ratios to `causal` is reported, and the medians of the times:

    causal   SDPA is_causal=True: no mask (what a window without document_mask runs)
    mask     SDPA with the (B, 1, T, T) boolean mask of kiln.models.documents.document_mask: what kiln runs
    split    each document's slice through SDPA is_causal=True alone (the boundaries read on the host: a sync)
    flex     torch's flex_attention with the BlockMask of document_block_mask (tried; torch 2.13 has no backward
             for it on a CPU, which the report says if so)

Then the whole model: a training step (forward, backward) of the default nano GPT-2 and of the same shape as
Llama, on (x, y) against (x, y, doc), alternating the same way; doc's building (positions, mask) is inside.

    .venv/bin/python benchmarks/document_mask.py [--reps 15] [--batch 8] [--seq 256] [--doc-len 64] [--no-split]
                                                 [--threads N]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from kiln.models import build_model
from kiln.models.config import ModelConfig
from kiln.models.documents import document_block_mask, document_mask


def random_docs(B: int, T: int, mean_len: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T) int32 document indices with boundaries drawn uniformly: about T / mean_len documents per window."""
    cuts = torch.rand(B, T, generator=gen) < 1.0 / mean_len
    cuts[:, 0] = False
    return cuts.cumsum(-1).to(torch.int32)


def attn_variants(doc: torch.Tensor):
    mask = document_mask(doc)
    bounds = [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in doc]

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def masked(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def split(q, k, v):
        rows = []
        for b, lengths in enumerate(bounds):
            parts = zip(*(t[b:b + 1].split(lengths, dim=2) for t in (q, k, v)))
            rows.append(torch.cat([F.scaled_dot_product_attention(*p, is_causal=True) for p in parts], dim=2))
        return torch.cat(rows)

    out = {"causal": causal, "mask": masked, "split": split}
    try:
        from torch.nn.attention.flex_attention import flex_attention
        block = document_block_mask(doc)
        q = torch.randn(1, 1, doc.shape[1], 16, requires_grad=True)
        flex_attention(q.expand(doc.shape[0], 1, -1, -1), q.expand(doc.shape[0], 1, -1, -1),
                       q.expand(doc.shape[0], 1, -1, -1), block_mask=block).sum().backward()
        out["flex"] = lambda q, k, v: flex_attention(q, k, v, block_mask=block)
    except Exception as e:  # noqa: BLE001 — reported, not hidden
        print(f"flex: not run: {type(e).__name__}: {str(e).splitlines()[0]}")
    return out


def alternate(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, taking turns; the first round is warm-up."""
    times = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return times


def report(title: str, times: dict[str, list[float]], base: str) -> None:
    print(f"\n{title}")
    print(f"{'variant':>8} {'median ms':>10} {'ratio to ' + base:>16}")
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, times[base]))
        print(f"{name:>8} {1e3 * statistics.median(ts):10.2f} {ratio:15.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--doc-len", type=int, default=64)
    ap.add_argument("--no-split", action="store_true", help="leave out the per-document split (10x the others' time)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = args.batch, args.seq
    gen = torch.Generator().manual_seed(0)
    doc = random_docs(B, T, args.doc_len, gen)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
          f"; B={B} T={T}, {float((doc[:, -1] + 1).float().mean()):.1f} documents per window on average")

    for dtype in (torch.float32, torch.bfloat16):
        H, D = 6, 64
        q, k, v = (torch.randn(B, H, T, D, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
        fns = {}
        for name, attn in attn_variants(doc).items():
            if name == "split" and args.no_split:
                continue
            def step(attn=attn):
                attn(q, k, v).sum().backward()
            fns[name] = step
        report(f"attention forward+backward, (B, H, T, D) = ({B}, {H}, {T}, {D}), {str(dtype)[6:]}",
               alternate(fns, args.reps), "causal")

    for arch in ("gpt2", "llama"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(preset="nano", arch=arch, max_seq_len=T, vocab_size=256).resolve())
        x = torch.randint(0, 256, (B, T), generator=gen)
        y = torch.randint(0, 256, (B, T), generator=gen)

        def plain():
            model(x, y, reduction="sum").backward()

        def masked():
            model(x, y, reduction="sum", doc=doc).backward()

        report(f"training step forward+backward, nano {arch} (fp32)", alternate({"plain": plain, "doc": masked},
                                                                               args.reps), "plain")


if __name__ == "__main__":
    main()
