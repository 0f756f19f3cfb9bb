"""kiln's training loop vs a plain nanoGPT-style fp32 loop of the same shape, alternating in one process.

Shape: 6 layers, 6 heads, width 384, seq 256, batch 8, byte vocabulary. kiln runs its real loop
(kiln.train.loop.Trainer, built by kiln.run.lm.build_lm, with its defaults: metrics every 10 steps, TensorBoard, the numerics guard, the
loader) in fp32 and, on a CPU with native bf16, in bf16 autocast. The plain loop is what a user writes first: fp32,
nn.Linear with biases, SDPA, tied embeddings, torch.optim.AdamW (foreach), clipping, no prefetch thread, no
logging. Blocks of `--block` steps rotate plain → kiln fp32 → kiln bf16, so machine noise hits all alike; the
ratio is of the summed times of the blocks after the first rotation (warm-up: allocator, kernel selection).

    .venv/bin/python benchmarks/throughput.py [--steps 60] [--block 10] [--no-bf16]
"""
from __future__ import annotations

import argparse
import io
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console

from kiln.config import load_config
from kiln.data import TokenLoader, prepare_data
from kiln.perf.hardware import native_bf16
from kiln.perf.measured import cpu_model
from kiln.train.schedule import lr_factor
from kiln.run.lm import build_lm
from kiln.train.loop import Trainer

SHAPE = dict(n_layer=6, n_head=6, d_model=384, seq_len=256, batch=8)
OVERRIDES = [f"--model.n_layer={SHAPE['n_layer']}", f"--model.n_head={SHAPE['n_head']}",
             f"--model.d_model={SHAPE['d_model']}", f"--data.seq_len={SHAPE['seq_len']}",
             f"--train.micro_batch_size={SHAPE['batch']}", "--optim.lr=1e-3", "--train.sample_tokens=0"]


class PlainBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """The loop a user writes first: fp32, nn.Linear, SDPA, tied embeddings."""

    def __init__(self, vocab, d, h, n_layer, seq_len):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(PlainBlock(d, h) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.T
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PlainLoop:
    """The plain loop; the defaults are this file's CPU shape. benchmarks/gpu_suite.py passes a GPT-2 shape, a CUDA
    device, bf16 autocast, fused AdamW and optionally torch.compile — what nanoGPT's train.py does on a GPU."""

    def __init__(self, tokens, lr: float, steps: int, schedule, *, vocab: int = 256, shape: dict | None = None,
                 device: str = "cpu", autocast: torch.dtype | None = None, fused: bool = False, compile: bool = False):
        shape = shape or SHAPE
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = PlainGPT(vocab, shape["d_model"], shape["n_head"], shape["n_layer"], shape["seq_len"])
        self.model.to(self.device)
        self.step_model = torch.compile(self.model) if compile else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                     **({"fused": True} if fused else {"foreach": True}))
        self.loader = TokenLoader(tokens, shape["batch"], shape["seq_len"], seed=0, prefetch=0)
        self.autocast = autocast
        self.lr, self.steps, self.schedule, self.step = lr, steps, schedule, 0

    def advance(self, until: int) -> None:
        while self.step < until:
            for g in self.opt.param_groups:
                g["lr"] = self.lr * lr_factor(self.schedule, self.step, self.steps)
            x, y = self.loader.next()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                                enabled=self.autocast is not None):
                loss = self.step_model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1


def kiln_loop(precision: str, steps: int, run_dir: str, overrides: list[str] | None = None) -> Trainer:
    # One step more than is timed: the last step of a run evaluates and checkpoints, which the plain loop never does.
    # `overrides` replaces this file's CPU shape (benchmarks/gpu_suite.py passes a GPT-2 124M shape on CUDA).
    base = OVERRIDES if overrides is None else overrides
    cfg = load_config(None, base + [f"--precision.mode={precision}", f"--train.max_steps={steps + 1}"])
    console = Console(file=io.StringIO(), width=120)
    return build_lm(cfg, run_dir, log=lambda m: None).trainer(run_dir, console)




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--block", type=int, default=10, help="steps per alternation block")
    ap.add_argument("--no-bf16", action="store_true", help="skip kiln bf16 even where the CPU has native bf16")
    args = ap.parse_args()

    unit = native_bf16()
    with tempfile.TemporaryDirectory() as tmp:
        loops = {"kiln fp32": kiln_loop("fp32", args.steps, f"{tmp}/fp32")}
        if unit and not args.no_bf16:
            loops["kiln bf16"] = kiln_loop("bf16", args.steps, f"{tmp}/bf16")
        cfg = loops["kiln fp32"].cfg
        data = prepare_data(cfg.data, log=lambda m: None)
        loops = {"plain fp32": PlainLoop(data.train, cfg.optim.lr, args.steps + 1, cfg.schedule)} | loops

        times = {name: 0.0 for name in loops}
        for start in range(0, args.steps, args.block):
            end = min(start + args.block, args.steps)
            for name, loop in loops.items():
                t = time.perf_counter()
                loop.advance(end)
                if start > 0:  # the first rotation is warm-up
                    times[name] += time.perf_counter() - t
        for loop in loops.values():
            if isinstance(loop, Trainer):
                loop.close()

    timed_steps = args.steps - min(args.block, args.steps)
    tokens = timed_steps * SHAPE["batch"] * SHAPE["seq_len"]
    tps = {name: tokens / t for name, t in times.items()}
    print(f"CPU: {cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__} | "
          f"ISA {torch.backends.cpu.get_cpu_capability()} | native bf16: {unit or 'none'}")
    print(f"{timed_steps} timed steps each of {SHAPE['batch']}x{SHAPE['seq_len']} tokens, "
          f"blocks of {args.block} alternating")
    for name, rate in tps.items():
        print(f"{name:12}{rate:>10,.0f} tokens/s")
    base = tps["plain fp32"]
    print(f"ratio kiln fp32 / plain fp32: {tps['kiln fp32'] / base:.3f}x")
    if "kiln bf16" in tps:
        print(f"ratio kiln bf16 / plain fp32: {tps['kiln bf16'] / base:.3f}x")
    else:
        print("ratio kiln bf16 / plain fp32: not measured (" + ("--no-bf16" if unit else "no native bf16 on this CPU")
              + ")")


if __name__ == "__main__":
    main()
