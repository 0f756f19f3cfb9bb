"""kiln's default CPU training step vs a minimal plain-PyTorch fp32 loop of the same shape.

Same data, same shape (6 layers, 6 heads, width 384, seq 256, batch 8, byte vocabulary), same number of steps.
The two run alternately in blocks so that machine noise hits both alike; prints tokens/s of each, the ratio,
and validation loss after the same steps.

    .venv/bin/python benchmarks/throughput.py [--steps 200] [--block 10]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.config import make_config
from kiln.data import TokenLoader, prepare_data, val_batches
from kiln.train.trainer import Run, train_step
from kiln.train.schedule import lr_factor

SHAPE = dict(n_layer=6, n_head=6, d_model=384, seq_len=256, batch=8)


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
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.T
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def val_loss(forward, tokens, batches=20):
    losses = [forward(x, y).item() for x, y in val_batches(tokens, SHAPE["batch"], SHAPE["seq_len"], batches)]
    return sum(losses) / len(losses)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block", type=int, default=10, help="steps per alternation block")
    args = ap.parse_args()
    torch.manual_seed(0)

    cfg = make_config()  # kiln's defaults: precision auto, fused AdamW, cosine schedule
    cfg.train.max_steps, cfg.train.sample_tokens, cfg.log.tensorboard = args.steps, 0, False
    run = Run(cfg, "runs/bench-throughput", log=lambda m: None)
    data = prepare_data(cfg.data, log=lambda m: None)
    plain = PlainGPT(256, SHAPE["d_model"], SHAPE["n_head"], SHAPE["n_layer"], SHAPE["seq_len"])
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95), weight_decay=0.1)
    plain_loader = TokenLoader(data.train, SHAPE["batch"], SHAPE["seq_len"], seed=cfg.data.seed, prefetch=0)

    def kiln_step(step):
        lr = cfg.optim.lr * lr_factor(cfg.schedule, step, args.steps)
        for g in run.optimizer.param_groups:
            g["lr"] = lr
        train_step(run.model, [run.loader.next()], run.optimizer, run.precision, run.scaler, cfg.optim)

    def plain_step(step):
        lr = cfg.optim.lr * lr_factor(cfg.schedule, step, args.steps)
        for g in plain_opt.param_groups:
            g["lr"] = lr
        x, y = plain_loader.next()
        loss = plain(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    times = {"kiln": 0.0, "plain": 0.0}
    for start in range(0, args.steps, args.block):
        for name, fn in (("kiln", kiln_step), ("plain", plain_step)):
            t = time.perf_counter()
            for step in range(start, min(start + args.block, args.steps)):
                fn(step)
            times[name] += time.perf_counter() - t
    tokens = args.steps * SHAPE["batch"] * SHAPE["seq_len"]
    tps = {k: tokens / v for k, v in times.items()}

    run.model.eval()
    plain.eval()

    def kiln_forward(x, y):
        with run.precision.autocast():
            return run.model(x, y)

    kiln_val, plain_val = val_loss(kiln_forward, data.val), val_loss(plain, data.val)
    run.loader.close()
    print(f"device: {torch.get_num_threads()} CPU threads | kiln precision {run.precision.mode} | {args.steps} steps "
          f"of {SHAPE['batch']}x{SHAPE['seq_len']} tokens")
    print(f"{'':8}{'tokens/s':>10}{'val_loss':>10}")
    print(f"{'kiln':8}{tps['kiln']:>10,.0f}{kiln_val:>10.4f}")
    print(f"{'plain':8}{tps['plain']:>10,.0f}{plain_val:>10.4f}")
    print(f"ratio kiln/plain: {tps['kiln'] / tps['plain']:.2f}x tokens/s | val loss {100 * (kiln_val / plain_val - 1):+.2f}%")
    assert math.isfinite(kiln_val)


if __name__ == "__main__":
    main()
