"""kiln vs a plain nanoGPT-style loop of our own, each a whole process, interleaved: steady tokens/s and the time of
the whole process (imports, build, data ready, 21 updates, final evaluation and checkpoint, exit).

Shape (kiln's `tiny` preset, nanoGPT's char-level shape): 6 layers × 384, 6 heads, seq 256, batch 8, byte
vocabulary (256), no biases, tied embeddings, AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on matrices),
clipping at 1.0, linear warm-up then cosine to 10%: kiln's defaults, which the plain loop copies. Data: the same
bytes for both, kiln's default corpus (this Python's standard library, byte-tokenized once into kiln's cache);
the plain loop reads kiln's train shard with np.memmap and draws random windows as nanoGPT's get_batch does.

Variants, each a fresh `python` process (rounds rotate the order, so machine noise hits all alike):
    plain-fp32   the plain loop in fp32 (nanoGPT's model.py/train.py in spirit: nn.Linear, SDPA, exact GELU,
                 torch's default AdamW, one loss.backward per step, no logging but the final evaluation)
    plain-bf16   the same under bf16 autocast (what nanoGPT does with dtype=bfloat16)
    kiln-fp32    `kiln train` in-process (the CLI's imports and parser, kiln.run.lm.train) with precision.mode=fp32
    kiln-bf16    the same with precision.mode=bf16
    kiln-fp32-mkl  kiln-fp32 with train.cpu_linear=torch: its linears through torch's F.linear (MKL on x86), as the
                 plain loop's, where kiln-fp32's auto may take oneDNN's (kiln.perf.cpu_linear)
    plain-fp32-tanh, plain-bf16-tanh   the plain loop with the tanh GELU of kiln's GPT-2 family (GPT-2's and Hugging
                 Face's gelu_new) in place of nanoGPT's exact one: the model kiln trains, so kiln-X against it is the
                 loop's overhead alone. The tanh GELU costs more on a CPU: at (8, 256, 1536) bf16 on one core of the
                 AMX Xeon its forward took 6.2 ms against 1.5 and its backward 6.5 against 4.0 (2026-11-27), ~6% of
                 a tiny step at one thread
    kiln-fp32-exact, kiln-bf16-exact   kiln-X with model.mlp=gelu_exact: nanoGPT's exact GELU, the plain loop's own
                 model, so kiln-X-exact against plain-X is also the loop's overhead alone
    kiln-bf16m-exact   kiln-bf16-exact with precision.mode=bf16-master: bf16 weights (fp32 masters in the optimizer),
                 no autocast, so no per-step casts of the weights or of fp32 norm outputs
Steady tokens/s: the tokens of updates 6..N over the time from the end of update 5 to the end of update N.
Printed ratios are medians over rounds of per-round ratios (each round's variants ran back to back).
CPU seconds (user + system, every thread of the child) are printed beside the wall clock: on a machine shared with
other work they count what a process did rather than how long it waited for a core; with OMP_NUM_THREADS=1 (no
OpenMP thread spinning while it waits for the others) they are the steadiest comparison a contended machine gives.

    PYTHONPATH=. python benchmarks/vs_plain_loop.py [--rounds 3] [--steps 21] [--variants plain-fp32,kiln-fp32,...]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SHAPE = dict(n_layer=6, n_head=6, d_model=384, seq_len=256, batch=8, vocab=256)
HYPER = dict(lr=2e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0, warmup=50, min_lr_ratio=0.1)
WARM = 5  # updates not counted in the steady rate
VARIANTS = ("plain-fp32", "kiln-fp32", "kiln-bf16", "plain-bf16", "kiln-fp32-mkl", "plain-fp32-tanh", "plain-bf16-tanh",
            "kiln-fp32-exact", "kiln-bf16-exact", "kiln-bf16m-exact")
PRECISION = {"fp32": "fp32", "bf16": "bf16", "bf16m": "bf16-master"}  # a kiln variant's second word -> precision.mode
BASE = "-base"  # with --base-tree DIR: each kiln variant once more from another checkout, as kiln-X-base (before/after
# a change, interleaved)
SHARD_DTYPES = {1: "u1", 2: "<u2", 4: "<u4"}  # kiln.data.shards' dtype codes (the plain loop imports no kiln)
EVAL_BATCHES = 20  # kiln's train.eval_batches default: the plain loop's final evaluation does the same work


def kiln_overrides(precision: str, steps: int, seed: int = 1337) -> list[str]:
    return ["--model.preset=tiny", f"--data.seq_len={SHAPE['seq_len']}", f"--train.micro_batch_size={SHAPE['batch']}",
            f"--train.max_steps={steps}", "--train.sample_tokens=0", f"--precision.mode={precision}",
            f"--train.seed={seed}", f"--data.seed={seed}"]


# ------------------------------------------------------------------------------------------- the plain loop

def plain_gpt(s: dict, reduction: str = "mean", gelu: str = "none"):
    """nanoGPT's model at shape `s` (SHAPE): tied embeddings, no biases, GPT-2's init; forward(idx, targets) is
    the cross-entropy (`reduction` as F.cross_entropy's); gelu: F.gelu's `approximate` ("none", nanoGPT's; "tanh",
    kiln's GPT-2 family's). torch is imported here: the plain child times its imports itself. Shared with
    benchmarks/time_to_loss.py."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
            q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate=gelu))

    class GPT(nn.Module):
        def __init__(self, s):
            super().__init__()
            d = s["d_model"]
            self.tok, self.pos = nn.Embedding(s["vocab"], d), nn.Embedding(s["seq_len"], d)
            self.blocks = nn.ModuleList(Block(d, s["n_head"]) for _ in range(s["n_layer"]))
            self.ln = nn.LayerNorm(d, bias=False)
            for name, p in self.named_parameters():
                if p.dim() > 1:  # GPT-2's init, residual projections scaled by 1/sqrt(2·n_layer)
                    std = 0.02 / math.sqrt(2 * s["n_layer"]) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, std=std)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))  # (B, T, C)
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.tok.weight.T  # (B, T, V)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)

    return GPT(s)


def read_shards(train_bin: str, val_bin: str):
    """kiln's shards as numpy memmaps: a 64-byte header, then the ids (uint8 for the bytes tokenizer since
    2026-11-27, else uint16); the header's dtype code (bytes 12-15) says which, as nanoGPT's prepare.py fixes uint16."""
    import numpy as np

    return tuple(np.memmap(path, dtype=SHARD_DTYPES[int(np.fromfile(path, "<u4", count=1, offset=12)[0])], mode="r",
                           offset=64) for path in (train_bin, val_bin))


def plain_child(args) -> dict:
    import math

    import numpy as np
    import torch

    imported, imported_cpu = time.time(), time.process_time()

    torch.manual_seed(args.seed)
    train, val = read_shards(args.train_bin, args.val_bin)
    B, T = SHAPE["batch"], SHAPE["seq_len"]

    def get_batch(data, gen=None):  # nanoGPT's get_batch
        ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    model = plain_gpt(SHAPE, gelu="tanh" if args.variant.endswith("-tanh") else "none")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": HYPER["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=HYPER["lr"],
                            betas=(HYPER["beta1"], HYPER["beta2"]))
    bf16 = args.variant.split("-")[1] == "bf16"
    ends, cpu_ends, losses = [], [], []
    warmup = min(HYPER["warmup"], args.steps)
    for step in range(args.steps):
        if step < warmup:
            factor = (step + 1) / warmup
        else:
            progress = (step - warmup) / max(1, args.steps - warmup)
            factor = HYPER["min_lr_ratio"] + (1 - HYPER["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = HYPER["lr"] * factor
        x, y = get_batch(train)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            losses.append(loss.item())  # nanoGPT logs every log_interval steps
        ends.append(time.time())
        cpu_ends.append(time.process_time())
    model.eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        val_loss = sum(model(*get_batch(val, gen)).item() for _ in range(EVAL_BATCHES)) / EVAL_BATCHES
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": args.steps},
               os.path.join(args.run_dir, "ckpt.pt"))
    return {"imported": imported, "ends": ends, "val_loss": val_loss, "threads": torch.get_num_threads(),
            "imported_cpu": imported_cpu, "cpu_ends": cpu_ends}


# ------------------------------------------------------------------------------------------------- kiln

def kiln_child(args) -> dict:
    import io

    from kiln.cli.common import config_from
    from kiln.cli.main import OVERRIDE, build_parser

    try:  # as the `kiln` command does once its first modules are loaded (a checkout from before it: nothing)
        from kiln.cli.finish import freeze_loaded
    except ImportError:
        pass
    else:
        freeze_loaded()

    imported, imported_cpu = time.time(), time.process_time()
    precision = PRECISION[args.variant.split("-")[1]]
    argv = ["train", "--run-dir", args.run_dir] + kiln_overrides(precision, args.steps, args.seed)
    if args.variant.endswith("-mkl"):
        argv.append("--train.cpu_linear=torch")
    if args.variant.endswith("-exact"):
        argv.append("--model.mlp=gelu_exact")
    parsed, _ = build_parser().parse_known_args([a for a in argv if not OVERRIDE.match(a)])
    cfg = config_from(parsed, [a for a in argv if OVERRIDE.match(a)])

    from rich.console import Console
    import torch

    from kiln.run.lm import train

    class Clock:
        def __init__(self):
            self.ends, self.cpu_ends = [], []

        def on_step_end(self, trainer, record):
            self.ends.append(time.time())
            self.cpu_ends.append(time.process_time())

    clock = Clock()
    result = train(cfg, args.run_dir, console=Console(file=io.StringIO()), callbacks=[clock])
    return {"imported": imported, "ends": clock.ends, "val_loss": result.val_loss,
            "threads": torch.get_num_threads(), "cpu_linear": result.cfg.train.cpu_linear_decided_by,
            "imported_cpu": imported_cpu, "cpu_ends": clock.cpu_ends}


# ------------------------------------------------------------------------------------------------ driver



def run_variant(variant: str, steps: int, seed: int, shards: tuple[str, str], tmp: str, tag: str,
                base_tree: str | None = None) -> dict:
    run_dir = os.path.join(tmp, f"{variant}-{tag}")
    os.makedirs(run_dir)
    out = os.path.join(tmp, f"{variant}-{tag}.json")
    base = variant.endswith(BASE)
    cmd = [sys.executable, __file__, "--child", variant.removesuffix(BASE), "--steps", str(steps),
           "--seed", str(seed), "--run-dir", run_dir, "--out", out, "--train-bin", shards[0], "--val-bin", shards[1]]
    env = dict(os.environ)
    if base:  # that checkout's kiln must accept kiln.run.lm.train(callbacks=...)
        env["PYTHONPATH"] = os.pathsep.join([base_tree] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawned = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.time() - spawned
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # the child's, all its threads
    r = json.load(open(out))
    ends, cpu_ends = r["ends"], r.get("cpu_ends")
    tokens = (steps - WARM) * SHAPE["batch"] * SHAPE["seq_len"]
    row = {"variant": variant, "wall_s": wall, "import_s": r["imported"] - spawned,
           "first_step_s": ends[0] - spawned, "steady_tok_s": tokens / (ends[steps - 1] - ends[WARM - 1]),
           "after_last_step_s": spawned + wall - ends[-1], "val_loss": r["val_loss"], "threads": r["threads"],
           "cpu_linear": r.get("cpu_linear"), "cpu_s": cpu}
    if cpu_ends:  # a --base-tree checkout from before 2026-11-27 records no CPU times
        row |= {"import_cpu_s": r["imported_cpu"], "first_step_cpu_s": cpu_ends[0],
                "steady_cpu_s_per_step": (cpu_ends[steps - 1] - cpu_ends[WARM - 1]) / (steps - WARM),
                "after_last_step_cpu_s": cpu - cpu_ends[-1]}
    return row


def prepared_shards(seed: int) -> tuple[str, str]:
    """kiln's default corpus, byte-tokenized into its cache (built once): the train and val shard files."""
    from kiln.config import load_config
    from kiln.data import prepare_data

    cfg = load_config(None, kiln_overrides("fp32", 21, seed))
    data = prepare_data(cfg.data, log=lambda m: None)
    meta = json.load(open(data.cache_dir / "meta.json"))
    train, val = (str(data.cache_dir / meta["shards"][split][0]) for split in ("train", "val"))
    assert len(meta["shards"]["train"]) == 1, "the plain loop reads one train shard"
    return train, val


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=21)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--variants", default="", help=f"comma-separated, of {VARIANTS} (default: all where the CPU has "
                    f"native bf16, else the fp32 two: emulated bf16 matmuls run ~7x slower than fp32)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--base-tree", help=f"also run each kiln variant from this checkout, as kiln-X{BASE}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    for hidden in ("--run-dir", "--out", "--train-bin", "--val-bin"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.variant = args.child
        r = (plain_child if args.child.startswith("plain") else kiln_child)(args)
        with open(args.out, "w") as f:
            json.dump(r, f)
        if args.child.startswith("kiln"):  # ends as the `kiln` command ends (a checkout from before it: as Python)
            try:
                from kiln.cli.finish import exit_process
            except ImportError:
                return
            exit_process(0)
        return
    if args.steps <= WARM:
        raise SystemExit(f"--steps must exceed the {WARM} warm-up updates")
    from kiln.perf.hardware import native_bf16
    from kiln.perf.measured import cpu_model

    variants = args.variants.split(",") if args.variants else list(VARIANTS if native_bf16() else VARIANTS[:2])
    if args.base_tree:
        variants += [v + BASE for v in variants if v.startswith("kiln")]
    unknown = {v.removesuffix(BASE) for v in variants} - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; use some of {VARIANTS}")
    shards = prepared_shards(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                row = run_variant(v, args.steps, args.seed, shards, tmp, str(r), args.base_tree) | {"round": r}
                rows.append(row)
                print(f"round {r} {v:11} steady {row['steady_tok_s']:8,.0f} tok/s | whole process {row['wall_s']:6.1f}"
                      f" s (imports {row['import_s']:.2f} s, step 1 ends at {row['first_step_s']:.1f} s, after the "
                      f"last step {row['after_last_step_s']:.1f} s) | val {row['val_loss']:.4f} | CPU {row['cpu_s']:.1f} s"
                      + (f" (imports {row['import_cpu_s']:.2f}, step 1 ends at {row['first_step_cpu_s']:.2f}, "
                         f"{row['steady_cpu_s_per_step']:.3f} per steady step, after the last step "
                         f"{row['after_last_step_cpu_s']:.2f})" if "import_cpu_s" in row else ""), flush=True)
    import torch

    print(f"\nCPU: {cpu_model()} | {rows[0]['threads']} threads | torch {torch.__version__} | ISA "
          f"{torch.backends.cpu.get_cpu_capability()} | load average {os.getloadavg()[0]:.1f}")
    print(f"{args.rounds} rounds × {args.steps} updates of {SHAPE['batch']}×{SHAPE['seq_len']} tokens; steady = updates "
          f"{WARM + 1}-{args.steps}")
    for v in variants:
        decided = {r["cpu_linear"] for r in rows if r["variant"] == v and r.get("cpu_linear")}
        if decided:
            print(f"{v} train.cpu_linear: {' / '.join(sorted(decided))}")
    med = {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v)
               for k in ("steady_tok_s", "wall_s", "import_s", "first_step_s", "after_last_step_s")} for v in variants}
    print(f"{'variant':16}{'steady tok/s':>14}{'whole s':>10}{'imports s':>11}{'step 1 end s':>14}{'after last s':>14}")
    for v in variants:
        m = med[v]
        print(f"{v:16}{m['steady_tok_s']:>14,.0f}{m['wall_s']:>10.1f}{m['import_s']:>11.2f}{m['first_step_s']:>14.1f}"
              f"{m['after_last_step_s']:>14.1f}")
    timed = [v for v in variants if all("import_cpu_s" in r for r in rows if r["variant"] == v)]
    cpu_keys = ("cpu_s", "import_cpu_s", "first_step_cpu_s", "steady_cpu_s_per_step", "after_last_step_cpu_s")
    print(f"CPU seconds, all threads (medians):\n{'variant':16}{'whole':>10}{'imports':>10}{'step 1 end':>12}"
          f"{'per steady step':>17}{'after last':>12}")
    for v in timed:
        m = [statistics.median(r[k] for r in rows if r["variant"] == v) for k in cpu_keys]
        print(f"{v:16}{m[0]:>10.2f}{m[1]:>10.2f}{m[2]:>12.2f}{m[3]:>17.3f}{m[4]:>12.2f}")
    by = {(r["round"], r["variant"]): r for r in rows}
    for v, plain in [(v, p) for v in variants if v.startswith("kiln") for p in variants  # kiln against the plain
                     if p in (f"plain-{v.split('-')[1]}", f"plain-{v.split('-')[1]}-tanh")]:  # loop of its precision
        for what, key, inverse in (("steady tok/s", "steady_tok_s", False), ("whole-process wall", "wall_s", True),
                                   ("steady CPU per step", "steady_cpu_s_per_step", True), ("whole CPU", "cpu_s", True)):
            if key in by[(0, v)] and key in by[(0, plain)]:
                q = [by[(r, v)][key] / by[(r, plain)][key] for r in range(args.rounds)]
                q = [1 / x for x in q] if inverse else q  # > 1: kiln is faster (or did less work)
                print(f"{v} vs {plain}, {what}: {statistics.median(q):.3f}x (rounds {min(q):.3f}-{max(q):.3f}; "
                      f"> 1: kiln faster)")
    if "plain-fp32" in variants:
        for v in variants:
            if v == "plain-fp32":
                continue
            speed = [by[(r, v)]["steady_tok_s"] / by[(r, "plain-fp32")]["steady_tok_s"] for r in range(args.rounds)]
            whole = [by[(r, v)]["wall_s"] / by[(r, "plain-fp32")]["wall_s"] for r in range(args.rounds)]
            print(f"ratio {v} / plain-fp32: steady {statistics.median(speed):.3f}x (rounds {min(speed):.3f}-"
                  f"{max(speed):.3f}) | whole-process time {statistics.median(whole):.3f}x (rounds {min(whole):.3f}-"
                  f"{max(whole):.3f}; < 1 is faster)")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
