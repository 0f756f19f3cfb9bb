"""Everything kiln wants measured on one CUDA GPU, in one command, most valuable part first.

Written for a fresh machine with one H100/H200, no network and a ~25 min window. Parts, each time-boxed, each
writing OUT/<part>.json and OUT/<part>.md the moment it ends (a run cut off later keeps what was done):

  tests       pytest -m gpu tests in a subprocess: junit XML, passed/failed/skipped counts, failures' names
  throughput  kiln's TrainingLoop vs benchmarks/throughput.py's plain loop at GPT-2 124M (seq 1024, bf16 autocast,
              SDPA, fused AdamW, same batch), alternating blocks in one process: tokens/s, ratio, MFU against the
              *measured* bf16 matmul rate, peak memory of each at equal batch; then kiln variants (Triton kernels,
              chunked loss, selective recompute at a larger batch) while the part's box lasts
  memory      the estimator's peak vs torch.cuda.max_memory_allocated over GPT-2 124M/350M, Llama-1B x
              {fp32, bf16, bf16-master} x {none, full, selective}; OOM points recorded, not fatal
  kernels     benchmarks/kernels.py --quick --no-write in a subprocess, its output captured

    .venv/bin/python benchmarks/gpu_suite.py --out gpu-results [--budget-min 20] [--compile] [--parts tests,memory]
    .venv/bin/python benchmarks/gpu_suite.py --out /tmp/r --dry-run   # same code paths, toy sizes, CPU, < 60 s

Data: kiln's offline byte corpus; at vocabulary 50257 the token ids are bytes (< 256) fed to a 50257-row (padded
50304) embedding and head, so the compute is GPT-2's even though the ids are not. The JSON says so.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

# Seconds per part on a GPU, in the order they run; the overall budget cuts the later ones first. 420 s of tests:
# the gpu-marked suite is ~60 cases, most a few seconds, the 1B estimator points ~20 s each.
BOXES = {"tests": 420, "throughput": 360, "memory": 300, "kernels": 240}
DRY_BOXES = {"tests": 60, "throughput": 30, "memory": 30, "kernels": 30}

GPT2 = dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, batch=16, preset="gpt2-124m")  # kiln's preset of it
TOY = dict(n_layer=2, n_head=2, d_model=64, seq_len=32, batch=2)


class Suite:
    def __init__(self, out: Path, budget_s: float, dry: bool):
        self.out, self.dry, self.deadline = out, dry, time.monotonic() + budget_s
        self.device = torch.device("cpu" if dry else "cuda")
        self.stamp = environment(self.device)
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self, part: str, data: dict, table: list[list]) -> None:
        data = {"part": part, "env": self.stamp, "dry_run": self.dry, **data}
        tmp = self.out / f"{part}.json.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str))
        tmp.replace(self.out / f"{part}.json")  # atomic: a run killed mid-write leaves the old file or none
        lines = [f"# {part}", "", f"{self.stamp['gpu']} | driver {self.stamp['driver']} | CUDA {self.stamp['cuda']} | "
                 f"torch {self.stamp['torch']} | triton {self.stamp['triton']} | {self.stamp['date']}"
                 + (" | DRY RUN (CPU, toy sizes)" if self.dry else ""), ""]
        if table:
            lines += ["| " + " | ".join(map(str, table[0])) + " |", "|" + "---|" * len(table[0])]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table[1:]]
        if data.get("error"):
            lines += ["", f"error: {data['error'].splitlines()[-1]}"]
        (self.out / f"{part}.md").write_text("\n".join(lines) + "\n")


def _cell(c) -> str:
    if isinstance(c, float):
        return f"{c:,.3f}" if abs(c) < 100 else f"{c:,.0f}"
    return str(c)


def environment(device: torch.device) -> dict:
    gpu = driver = "none"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip() or "unknown"
        except (OSError, subprocess.TimeoutExpired):
            driver = "unknown (nvidia-smi unavailable)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {"gpu": gpu, "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
            "triton": triton_version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- tests
def part_tests(s: Suite, box: float) -> None:
    xml = s.out / "tests-junit.xml"
    select = ["-m", "gpu", "tests/memory/test_levers.py"] if s.dry else ["-m", "gpu", "tests"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *select]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=box)
        rc, tail, timed_out = proc.returncode, (proc.stdout + proc.stderr)[-6000:], False
    except subprocess.TimeoutExpired as e:
        rc, timed_out = None, True
        tail = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))[-6000:]
    counts, failures = junit_summary(xml)
    s.write("tests", {"command": " ".join(cmd[1:]), "returncode": rc, "timed_out": timed_out,
                      "seconds": time.monotonic() - t0, **counts, "failures": failures, "output_tail": tail,
                      "junit": xml.name if xml.exists() else None},
            [["tests", "passed", "failed", "errors", "skipped", "seconds"],
             [counts["tests"], counts["passed"], counts["failed"], counts["errors"], counts["skipped"],
              time.monotonic() - t0]] + [[f"FAILED {f}", "", "", "", "", ""] for f in failures])


def junit_summary(xml: Path) -> tuple[dict, list[str]]:
    """Counts and failing test ids from pytest's junit XML; zeros when it was never written (timeout)."""
    counts = dict(tests=0, passed=0, failed=0, errors=0, skipped=0)
    failures: list[str] = []
    if not xml.exists():
        return counts, failures
    for case in ET.parse(xml).getroot().iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failures.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failures.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures


# ---------------------------------------------------------------- throughput
def matmul_rate(device: torch.device, dry: bool) -> dict:
    """Best-of-N achieved matmul FLOP/s: the MFU denominator is what this GPU really does, not the datasheet's."""
    n, dtype, reps, trials = (256, torch.float32, 4, 3) if dry else (8192, torch.bfloat16, 20, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    best = math.inf
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "dtype": str(dtype), "flops_per_s": 2 * n**3 * reps / best, "trials": trials}


def kiln_overrides(shape: dict, vocab: int, device: torch.device, extra: list[str]) -> list[str]:
    preset = [f"--model.preset={shape['preset']}"] if "preset" in shape else [
        f"--model.n_layer={shape['n_layer']}", f"--model.n_head={shape['n_head']}",
        f"--model.d_model={shape['d_model']}"]
    return preset + [f"--model.vocab_size={vocab}", f"--data.seq_len={shape['seq_len']}",
                     f"--train.micro_batch_size={shape['batch']}", f"--train.device={device.type}",
                     "--optim.lr=6e-4", "--train.sample_tokens=0", *extra]


def part_throughput(s: Suite, box: float, compile_: bool, steps: int, block: int, batch: int | None) -> None:
    from throughput import PlainLoop, kiln_loop
    from kiln.config import load_config
    from kiln.data import prepare_data
    from kiln.train.trainer import TrainingLoop

    t_end = time.monotonic() + box
    dev = s.device
    shape = dict(TOY if s.dry else GPT2)
    if batch:
        shape["batch"] = batch
    vocab = 256 if s.dry else 50257
    padded = (vocab + 63) // 64 * 64  # kiln pads to a multiple of 64 (models/config.py); the plain model gets the same
    precision, autocast = ("fp32", None) if s.dry else ("bf16", torch.bfloat16)
    flag = ["--train.compile=true"] if compile_ else []
    data_note = ("byte corpus (ids < 256) into a 50257-token model (padded 50304)" if vocab == 50257
                 else "byte corpus, byte vocabulary")
    chunk = 4 * shape["seq_len"] // (1 if s.dry else 4)
    lean = [f"--memory.chunked_loss={chunk}", "--memory.recompute=selective"]
    variants = {"kiln triton kernels": (["--model.kernels=triton"], shape["batch"]),
                f"kiln chunked_loss={chunk}": ([f"--memory.chunked_loss={chunk}"], shape["batch"]),
                "kiln chunked+selective": (lean, shape["batch"]),  # the peak ≤ 0.5x plain target, equal batch
                "kiln chunked+selective 2x batch": (lean, 2 * shape["batch"])}
    result = {"shape": shape, "vocab": vocab, "padded_vocab": padded, "data": data_note, "kiln_precision": precision,
              "plain_precision": "bf16 autocast, fp32 weights" if autocast else "fp32", "compile": compile_,
              "steps": steps, "block": block,
              "variants_planned": list(variants)}  # the merge lists those a cut-off run never reached
    rate = matmul_rate(dev, s.dry)
    result["matmul"] = rate
    table = [["loop", "tokens/s", "ratio vs plain", "MFU (measured peak)", "peak MiB"]]

    with tempfile.TemporaryDirectory() as tmp:
        built = iter(range(1 << 30))  # a fresh run folder per build: a reused one could resume a checkpoint

        def make(name, extra, b):
            sh = dict(shape, batch=b)
            if name == "plain":
                cfg = load_config(None, kiln_overrides(sh, vocab, dev, []))  # same data, lr, schedule as kiln's
                data = prepare_data(cfg.data, log=lambda m: None)
                return PlainLoop(data.train, cfg.optim.lr, steps + 1, cfg.schedule, vocab=padded, shape=sh,
                                 device=str(dev), autocast=autocast, fused=dev.type == "cuda", compile=compile_)
            return kiln_loop(precision, steps, f"{tmp}/run{next(built)}",
                             kiln_overrides(sh, vocab, dev, flag + extra))

        # 1. tokens/s: plain and kiln alternate in blocks so machine noise hits both alike; the first rotation is
        # warm-up (allocator, cuBLAS heuristics, compile).
        loops = {"plain": make("plain", [], shape["batch"]), "kiln": make("kiln", [], shape["batch"])}
        fpt = loops["kiln"].flops_per_token
        times = {name: 0.0 for name in loops}
        for start in range(0, steps, block):
            end = min(start + block, steps)
            for name, loop in loops.items():
                sync(dev)
                t = time.perf_counter()
                loop.advance(end)
                sync(dev)
                if start > 0:
                    times[name] += time.perf_counter() - t
        tokens = (steps - block) * shape["batch"] * shape["seq_len"]
        for loop in loops.values():
            if isinstance(loop, TrainingLoop):
                loop.close()
        del loop  # the for-loops' variable would keep the last model and optimizer resident through the peaks below
        loops.clear()
        release(dev)
        rows = {}
        for name, t in times.items():
            tps = tokens / t
            rows[name] = {"tokens_per_s": tps, "mfu": tps * fpt / rate["flops_per_s"], "batch": shape["batch"]}
        result["flops_per_token"] = fpt
        result["ratio_kiln_over_plain"] = rows["kiln"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]

        # 2. peak memory at equal batch, each loop alone on the device (both resident would count each other's state).
        for name in ("plain", "kiln"):
            rows[name]["peak_bytes"] = peak_of(lambda: make(name, [], shape["batch"]), dev, min(3, steps))
        result["loops"] = rows
        s.write("throughput", result, table + _rows(rows, rows["plain"]["tokens_per_s"]))

        # 3. kiln variants while the box lasts: each timed alone (steps after a warm-up block) and its peak.
        result["variants"] = {}
        for name, (extra, b) in variants.items():
            if "--model.kernels=triton" in extra and dev.type != "cuda":
                result["variants"][name] = {"skipped": "Triton kernels need CUDA"}
                continue
            if time.monotonic() > t_end or s.left() < 60 and not s.dry:
                result["variants"][name] = {"skipped": "time box spent"}
                continue
            try:
                tps, peak = time_alone(lambda: make(name, extra, b), dev, block, steps)
                tps *= b * shape["seq_len"]
                plain_peak = rows["plain"]["peak_bytes"]
                result["variants"][name] = {"tokens_per_s": tps, "mfu": tps * fpt / rate["flops_per_s"], "batch": b,
                                            "peak_bytes": peak, "overrides": extra,
                                            "peak_vs_plain": peak / plain_peak if peak and plain_peak else None}
            except Exception as e:  # one variant failing (e.g. Triton missing) must not lose the others
                result["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            release(dev)
            s.write("throughput", result, table + _rows({**rows, **result["variants"]}, rows["plain"]["tokens_per_s"]))


def time_alone(build, dev: torch.device, block: int, steps: int) -> tuple[float, int | None]:
    """(steps/s after a warm-up block, max_memory_allocated or None on CPU) of a freshly built loop, alone."""
    release(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    loop = build()
    try:
        loop.advance(block)
        sync(dev)
        t = time.perf_counter()
        loop.advance(steps)
        sync(dev)
        rate = (steps - block) / (time.perf_counter() - t)
        return rate, torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    finally:
        loop.close()


def peak_of(build, dev: torch.device, steps: int) -> int | None:
    """torch.cuda.max_memory_allocated over `steps` steps of a freshly built loop (None on CPU)."""
    if dev.type != "cuda":
        return None
    release(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    loop = build()
    loop.advance(steps)
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    if hasattr(loop, "close"):
        loop.close()
    del loop
    release(dev)
    return peak


def _rows(rows: dict, base: float) -> list[list]:
    out = []
    for name, r in rows.items():
        if "tokens_per_s" not in r:
            out.append([name, r.get("error") or r.get("skipped"), "", "", ""])
            continue
        peak = r.get("peak_bytes")
        out.append([name, r["tokens_per_s"], r["tokens_per_s"] / base, r["mfu"],
                    f"{peak / 2**20:,.0f}" if peak else "n/a (CPU)"])
    return out


# ---------------------------------------------------------------- memory estimator
GRID_MODELS = {
    "gpt2-124m": ["--model.preset=gpt2-124m", "--data.seq_len=1024", "--train.micro_batch_size=4"],
    "gpt2-350m": ["--model.preset=gpt2-350m", "--data.seq_len=1024", "--train.micro_batch_size=2"],
    "llama-1b": ["--model.preset=llama-1b", "--data.seq_len=1024", "--train.micro_batch_size=1",
                 "--model.vocab_size=128256"],
}


def part_memory(s: Suite, box: float) -> None:
    from kiln.config import load_config
    from kiln.memory.devices import local_device
    from kiln.memory.estimate import estimate, peak_allocated
    from kiln.memory.levers import job_for
    from kiln.memory.measure import measure_step

    t_end = time.monotonic() + box
    if s.dry:
        toy = [f"--model.n_layer={TOY['n_layer']}", f"--model.n_head={TOY['n_head']}",
               f"--model.d_model={TOY['d_model']}", f"--data.seq_len={TOY['seq_len']}",
               f"--train.micro_batch_size={TOY['batch']}", "--train.device=cpu"]
        grid = [("toy", toy, "fp32", r) for r in ("none", "full")]
    else:
        common = ["--data.tokenizer=bpe", "--data.vocab_size=50257", "--train.device=cuda"]
        grid = [(m, args + common, p, r) for m, args in GRID_MODELS.items()
                for p in ("fp32", "bf16", "bf16-master") for r in ("none", "full", "selective")]
    points = []
    table = [["model", "precision", "recompute", "predicted MiB", "measured MiB", "rel. error"]]
    for model, args, precision, recompute in grid:
        point = {"model": model, "precision": precision, "recompute": recompute}
        if time.monotonic() > t_end or (s.left() < 30 and not s.dry):
            point["skipped"] = "time box spent"
        else:
            try:
                cfg = load_config(None, args + [f"--precision.mode={precision}", f"--memory.recompute={recompute}"])
                predicted = peak_allocated(estimate(job_for(cfg, local_device(s.device))))
                measured = measure_step(cfg, s.device, steps=3).step_peaks[-1]
                point.update(predicted_bytes=predicted, measured_bytes=measured,
                             rel_error=(predicted - measured) / measured)
            except torch.OutOfMemoryError:
                point["skipped"] = "OOM"
            except Exception as e:
                point["error"] = f"{type(e).__name__}: {e}"[:500]
            release(s.device)
        points.append(point)
        row = [model, precision, recompute]
        if "rel_error" in point:
            row += [point["predicted_bytes"] / 2**20, point["measured_bytes"] / 2**20, f"{point['rel_error']:+.2%}"]
        else:
            row += [point.get("skipped") or point.get("error"), "", ""]
        table.append(row)
        errs = [abs(p["rel_error"]) for p in points if "rel_error" in p]
        s.write("memory", {"points": points, "max_abs_rel_error": max(errs) if errs else None,
                           "within_3pct": all(e <= 0.03 for e in errs) if errs else None,
                           "steps_per_point": 3, "grid_planned": [[m, p, r] for m, _, p, r in grid]}, table)


# ---------------------------------------------------------------- kernels
def part_kernels(s: Suite, box: float) -> None:
    cmd = [sys.executable, "benchmarks/kernels.py", "--quick", "--no-write"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=box)
        rc, out, timed_out = proc.returncode, proc.stdout + proc.stderr, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, timed_out = None, True
    s.write("kernels", {"command": " ".join(cmd[1:]), "returncode": rc, "timed_out": timed_out,
                        "seconds": time.monotonic() - t0, "output": out[-20000:]},
            [["returncode", "timed out", "seconds"], [rc, timed_out, time.monotonic() - t0]])
    (s.out / "kernels.md").open("a").write("\n```\n" + out[-20000:] + "\n```\n")


PARTS = {"tests": part_tests, "throughput": part_throughput, "memory": part_memory, "kernels": part_kernels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-results", help="folder for <part>.json and <part>.md")
    ap.add_argument("--budget-min", type=float, default=20.0, help="overall wall-clock budget in minutes")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, same code paths (< 60 s)")
    ap.add_argument("--compile", action="store_true", help="torch.compile both loops (--train.compile=true for kiln)")
    ap.add_argument("--steps", type=int, default=0, help="throughput steps per loop (default 60; dry run 4)")
    ap.add_argument("--block", type=int, default=0, help="steps per alternation block (default 10; dry run 2)")
    ap.add_argument("--batch", type=int, default=0, help="throughput micro-batch (default 16 on GPU)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_suite.py needs a CUDA GPU (torch sees none); use --dry-run to exercise it on CPU")
    steps = args.steps or (4 if args.dry_run else 60)
    block = args.block or (2 if args.dry_run else 10)
    if not 0 < block < steps:
        ap.error(f"--block must be in 1..steps-1 (the first block is warm-up), got block={block} steps={steps}")

    s = Suite(Path(args.out), args.budget_min * 60, args.dry_run)
    boxes = DRY_BOXES if args.dry_run else BOXES
    status = {}
    for name in parts:
        box = min(boxes[name], s.left())
        if box < 10:
            status[name] = "skipped: overall budget spent"
            s.write(name, {"skipped": "overall budget spent"}, [])
            continue
        t0 = time.monotonic()
        print(f"[gpu_suite] {name}: box {box:.0f} s, {s.left():.0f} s left overall", flush=True)
        try:
            if name == "throughput":
                part_throughput(s, box, args.compile, steps, block, args.batch or None)
            else:
                PARTS[name](s, box)
            status[name] = "done"
        except Exception:  # a broken part is recorded and the next one still runs
            status[name] = "error"
            prior = s.out / f"{name}.json"
            kept = json.loads(prior.read_text()) if prior.exists() else {}
            kept = {k: v for k, v in kept.items() if k not in ("part", "env", "dry_run")}
            s.write(name, {**kept, "error": traceback.format_exc()}, [])
            traceback.print_exc()
        release(s.device)
        print(f"[gpu_suite] {name}: {status[name]} in {time.monotonic() - t0:.1f} s", flush=True)
    (s.out / "summary.json").write_text(json.dumps({"env": s.stamp, "parts": status}, indent=2))
    return 0 if all(v == "done" for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
