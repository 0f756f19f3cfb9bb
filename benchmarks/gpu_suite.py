"""Everything kiln wants measured on one CUDA GPU, in one command, most valuable part first.

Written for a fresh machine with one H100/H200, no network and a ~25 min window. Parts, each time-boxed, each
writing OUT/<part>.json and OUT/<part>.md the moment it ends (a run cut off later keeps what was done):

  tests       pytest -m gpu tests in a subprocess: junit XML, passed/failed/skipped counts, failures' names, the
              whole output in tests.log (a run cut off by its box is counted from pytest -v's lines)
  throughput  kiln's Trainer vs benchmarks/throughput.py's plain loop at GPT-2 124M (seq 1024, bf16 autocast,
              SDPA, fused AdamW, same batch), alternating blocks in one process: tokens/s, ratio, MFU against the
              *measured* bf16 matmul rate, peak memory of each at equal batch; then kiln variants (Triton kernels,
              chunked loss, selective recompute at a larger batch) while the part's box lasts
  memory      the estimator's peak vs torch.cuda.max_memory_allocated over GPT-2 124M/350M, Llama-1B x
              {fp32, bf16, bf16-master} x {none, full, selective}; OOM points recorded, not fatal
  kernels     benchmarks/kernels.py --quick --no-write in a subprocess, its output captured
  profile     `kiln profile` of GPT-2 124M in bf16 (kiln.run.profile): the step's parts, device idle, the top
              operations and the verdict
  fp8         precision.mode=fp8 (torchao's float8 linears) against bf16 at GPT-2 350M, both compiled: tokens/s,
              peak memory and the training loss after the same steps; torchao must be importable there (carry its
              wheel: docs/benchmarks.md)

    .venv/bin/python benchmarks/gpu_suite.py --out gpu-results [--budget-min 20] [--compile] [--parts tests,memory]
    .venv/bin/python benchmarks/gpu_suite.py --out /tmp/r --dry-run   # same code paths, toy sizes, CPU, < 60 s
    .venv/bin/python benchmarks/gpu_suite.py merge gpu-results [--doc docs/benchmarks.md]

`merge` renders every part's JSON as a table (stamp, numbers, which targets were reached) and writes them into the
doc between its gpu-suite marker comments, leaving the rest of the file byte for byte; a part missing or cut off by
its time box is a row saying so. It refuses dry-run results unless given --allow-dry-run (for tests).

Data: kiln's offline byte corpus; at vocabulary 50257 the token ids are bytes (< 256) fed to a 50257-row (padded
50304) embedding and head, so the compute is GPT-2's even though the ids are not. The JSON says so.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
import torch._dynamo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

# Seconds per part on a GPU, in the order they run; the overall budget (20 min) cuts the later ones first. Tests:
# 296 gpu-marked cases (240 of them the host-sync matrix). Throughput: ~8 torch.compile builds of GPT-2 124M,
# the first of each shape cold, later ones from inductor's cache. These boxes are guesses until a GPU run times them.
BOXES = {"tests": 360, "throughput": 420, "memory": 270, "kernels": 180, "profile": 90, "fp8": 240}
DRY_BOXES = {"tests": 60, "throughput": 120, "memory": 30, "kernels": 30, "profile": 30, "fp8": 30}

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
    """Between builds: memory back, and torch.compile's state dropped, so each build compiles for its own shapes
    and module types (inductor's on-disk cache keeps that quick) rather than adding to the last build's cache:
    there a new shape turns on automatic dynamic shapes (other kernels than a fresh run gets) and the 9th variant
    of one forward would hit dynamo's recompile limit and run eager."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- tests
def part_tests(s: Suite, box: float) -> None:
    xml = s.out / "tests-junit.xml"
    select = ["-m", "gpu", "tests/memory/test_levers.py"] if s.dry else ["-m", "gpu", "tests"]
    # -v: one line per test as it ends, so a run the box cuts off (pytest killed, no junit XML) is still counted
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", *select]
    xml.unlink(missing_ok=True)  # an earlier run's XML must not be read as this one's
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=box)
        rc, out, timed_out = proc.returncode, proc.stdout + proc.stderr, False
    except subprocess.TimeoutExpired as e:
        rc, timed_out = None, True
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    (s.out / "tests.log").write_text(out)
    tail = out[-6000:]
    counts, failures = junit_summary(xml) if xml.exists() else verbose_summary(out)
    s.write("tests", {"command": " ".join(cmd[1:]), "returncode": rc, "timed_out": timed_out,
                      "seconds": time.monotonic() - t0, **counts, "failures": failures, "output_tail": tail,
                      "junit": xml.name if xml.exists() else None},
            [["tests", "passed", "failed", "errors", "skipped", "seconds"],
             [counts["tests"], counts["passed"], counts["failed"], counts["errors"], counts["skipped"],
              time.monotonic() - t0]] + [[f"FAILED {f}", "", "", "", "", ""] for f in failures])


VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def verbose_summary(text: str) -> tuple[dict, list[str]]:
    """Counts and failing test ids from pytest -v's per-test lines: what finished before a time box killed it."""
    counts = dict(tests=0, passed=0, failed=0, errors=0, skipped=0)
    failures: list[str] = []
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
           "XFAIL": "skipped"}
    for name, outcome in VERBOSE_LINE.findall(text):
        counts["tests"] += 1
        counts[key[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            failures.append(name)
    return counts, failures


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
    from kiln.train.loop import Trainer

    t_end = time.monotonic() + box
    dev = s.device
    shape = dict(TOY if s.dry else GPT2)
    if batch:
        shape["batch"] = batch
    vocab = 256 if s.dry else 50257
    padded = (vocab + 63) // 64 * 64  # kiln pads to a multiple of 64 (models/config.py); the plain model gets the same
    precision, autocast = ("fp32", None) if s.dry else ("bf16", torch.bfloat16)
    flag = ["--train.compile=true"] if compile_ else []
    # The dry run compiles the two main loops (dynamo, AOT autograd and inductor all run) but times the variants
    # eager: each variant's inductor build costs 15-35 s of C++ compilation on a 2-core CPU (about 100 s of the
    # suite's dry run on the 2-core Zen 5 of 2026-11-27), and on the GPU a variant that fails costs only its row.
    variant_flag = flag if not s.dry else []
    data_note = ("byte corpus (ids < 256) into a 50257-token model (padded 50304)" if vocab == 50257
                 else "byte corpus, byte vocabulary")
    chunk = 4 * shape["seq_len"] // (1 if s.dry else 4)
    lean = [f"--memory.chunked_loss={chunk}", "--memory.recompute=selective"]
    # most valuable first: the box may end before the last ones
    variants = {"kiln chunked+selective": (lean, shape["batch"]),  # the peak ≤ 0.5x plain target, equal batch
                "kiln triton kernels": (["--train.kernels=triton"], shape["batch"]),
                f"kiln chunked_loss={chunk}": ([f"--memory.chunked_loss={chunk}"], shape["batch"]),
                "kiln chunked+selective 2x batch": (lean, 2 * shape["batch"])}
    result = {"shape": shape, "vocab": vocab, "padded_vocab": padded, "data": data_note, "kiln_precision": precision,
              "plain_precision": "bf16 autocast, fp32 weights" if autocast else "fp32", "compile": compile_,
              "variants_compile": bool(variant_flag), "steps": steps, "block": block,
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
                             kiln_overrides(sh, vocab, dev, extra))

        # 1. tokens/s: plain and kiln alternate in blocks so machine noise hits both alike; the first rotation is
        # warm-up (allocator, cuBLAS heuristics, compile).
        loops = {"plain": make("plain", [], shape["batch"]), "kiln": make("kiln", flag, shape["batch"])}
        fpt = loops["kiln"].metrics.flops_per_unit
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
            if isinstance(loop, Trainer):
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
            rows[name]["peak_bytes"] = peak_of(lambda: make(name, flag, shape["batch"]), dev, min(3, steps))
        result["loops"] = rows
        s.write("throughput", result, table + _rows(rows, rows["plain"]["tokens_per_s"]))

        # 3. kiln variants while the box lasts: each timed alone (steps after a warm-up block) and its peak.
        result["variants"] = {}
        for name, (extra, b) in variants.items():
            if "--train.kernels=triton" in extra and dev.type != "cuda":
                result["variants"][name] = {"skipped": "Triton kernels need CUDA"}
                continue
            if time.monotonic() > t_end or s.left() < 60 and not s.dry:
                result["variants"][name] = {"skipped": "time box spent"}
                continue
            try:
                tps, peak = time_alone(lambda: make(name, variant_flag + extra, b), dev, block, steps)
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
    from kiln.memory.levers import JobSections, job_for
    from kiln.run.measure import measure_step

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
                predicted = peak_allocated(estimate(job_for(JobSections.of(cfg), local_device(s.device))))
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


def part_profile(s: Suite, box: float) -> None:
    """`kiln profile` of the throughput part's kiln configuration: its step breakdown and verdict."""
    from kiln.config import load_config
    from kiln.run.profile import profile_run, report_lines

    shape, vocab = (dict(TOY), 256) if s.dry else (dict(GPT2), 50257)
    precision = "fp32" if s.dry else "bf16"
    cfg = load_config(None, kiln_overrides(shape, vocab, s.device, [f"--precision.mode={precision}"]))
    steps, warmup = (3, 1) if s.dry else (20, 5)
    with tempfile.TemporaryDirectory() as tmp:
        r = profile_run(cfg, Path(tmp) / "run", steps=steps, warmup=warmup, log=lambda m: None)
        summary = {k: v for k, v in r.summary().items() if k != "files"}
    table = [["part", "ms per step", "share"]] + [[name, 1000 * sec, f"{sec / summary['step_s']:.1%}"]
                                                   for name, sec in summary["breakdown"].items()]
    s.write("profile", {"shape": shape, "precision": precision, "summary": summary, "report": report_lines(r)}, table)


def part_fp8(s: Suite, box: float) -> None:
    """bf16, then fp8, each built alone, compiled, timed after a warm-up block; the loss of the last step."""
    from throughput import kiln_loop

    dev, t_end = s.device, time.monotonic() + box
    shape = dict(TOY if s.dry else dict(preset="gpt2-350m", seq_len=1024, batch=8))
    vocab = 256 if s.dry else 50257
    steps, block = (4, 2) if s.dry else (40, 10)
    result = {"shape": shape, "vocab": vocab, "steps": steps, "block": block, "compile": not s.dry, "modes": {}}
    try:
        import torchao  # noqa: F401  (only whether it is there)

        result["torchao"] = torchao.__version__
    except ImportError:
        result["torchao"] = None
    table = [["precision", "tokens/s", "vs bf16", "peak MiB", f"loss at step {steps}"]]
    for mode in ("bf16", "fp8"):
        if time.monotonic() > t_end:
            result["modes"][mode] = {"skipped": "time box spent"}
            continue
        extra = ["--log.interval=1", "--log.tensorboard=false"] + ([] if s.dry else ["--train.compile=true"])
        try:
            with tempfile.TemporaryDirectory() as tmp:
                run = f"{tmp}/{mode}"
                rate, peak = time_alone(lambda: kiln_loop(mode, steps, run, kiln_overrides(shape, vocab, dev, extra)),
                                        dev, block, steps)
                lines = Path(run, "metrics.jsonl").read_text().splitlines()
                train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
                result["modes"][mode] = {"tokens_per_s": rate * shape["batch"] * shape["seq_len"], "peak_bytes": peak,
                                         "final_loss": train[-1]["loss"], "final_step": train[-1]["step"]}
        except Exception as e:  # fp8 refused (CPU, an older GPU) or torchao missing: recorded, not fatal
            result["modes"][mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
        release(dev)
    base = result["modes"].get("bf16", {}).get("tokens_per_s")
    for mode, r in result["modes"].items():
        if "tokens_per_s" in r:
            table.append([mode, r["tokens_per_s"], r["tokens_per_s"] / base if base else "", mib(r["peak_bytes"]),
                          r["final_loss"]])
        else:
            table.append([mode, r.get("error") or r.get("skipped"), "", "", ""])
    s.write("fp8", result, table)


PARTS = {"tests": part_tests, "throughput": part_throughput, "memory": part_memory, "kernels": part_kernels,
         "profile": part_profile, "fp8": part_fp8}


# ---------------------------------------------------------------- merge into docs/benchmarks.md
BEGIN, END = "<!-- gpu-suite:begin -->", "<!-- gpu-suite:end -->"
DOC = ROOT / "docs" / "benchmarks.md"
NOT_REACHED = "not run (the suite stopped before it)"


class MergeError(Exception):
    """A results folder or document the merge cannot use; the merge command prints it as one `error:` line."""


def merge(results: Path, doc: Path, allow_dry_run: bool = False) -> str:
    """Renders RESULTS's <part>.json files and writes them into DOC between the gpu-suite markers; returns the block.

    Dry-run results are refused unless allowed: toy CPU numbers must never land in the docs by accident.
    """
    parts = load_parts(results)
    dry = [f"{name}.json" for name, data in parts.items() if data is not None and not from_gpu(data)]
    if dry and not allow_dry_run:
        raise MergeError(f"{', '.join(dry)} in {results} come from a dry run (CPU, toy sizes), not a GPU; their "
                         f"numbers must not land in {doc.name}. Run `make gpu-check` on a CUDA machine and merge "
                         "its gpu-results (--allow-dry-run is for tests)")
    if not doc.is_file():
        raise MergeError(f"{doc} not found")
    body = render(parts, finished=(results / "summary.json").exists())
    text = doc.read_bytes().decode("utf-8")  # bytes, not read_text: universal newlines would rewrite any \r\n
    merged = put_between_markers(text, body, doc)
    if merged != text:
        doc.write_bytes(merged.encode("utf-8"))
    return body


def load_parts(results: Path) -> dict[str, dict | None]:
    """Each part's JSON, None where its file is missing; at least one must exist."""
    if not results.is_dir():
        raise MergeError(f"{results} is not a folder; `make gpu-check` writes gpu-results/")
    parts = {}
    for name in PARTS:
        path = results / f"{name}.json"
        try:
            parts[name] = json.loads(path.read_text()) if path.exists() else None
        except json.JSONDecodeError as e:
            raise MergeError(f"{path} is not valid JSON ({e})") from None
    if not any(parts.values()):
        raise MergeError(f"{results} holds none of {', '.join(f'{p}.json' for p in PARTS)}; "
                         "`make gpu-check` writes them")
    return parts


def from_gpu(data: dict) -> bool:
    return data.get("dry_run") is False and str(data.get("env", {}).get("device", "")).startswith("cuda")


def put_between_markers(text: str, body: str, doc: Path) -> str:
    """TEXT with BODY between the markers and every byte outside them as it was. Missing markers are added, with
    BODY, at the end of the "## GPU suite" section, or at the end of the file if it has no such section."""
    n_begin, n_end = text.count(BEGIN), text.count(END)
    if n_begin == n_end == 0:
        block = f"{BEGIN}\n{body}{END}"
        section = re.search(r"^## GPU suite\b", text, re.M)
        after = re.compile(r"^## ", re.M).search(text, section.end()) if section else None
        at = after.start() if after else len(text)
        head = text[:at]
        gap = "" if not head or head.endswith("\n\n") else "\n" if head.endswith("\n") else "\n\n"
        return head + gap + block + ("\n\n" if after else "\n") + text[at:]
    begin, end = text.find(BEGIN), text.find(END)
    if n_begin != 1 or n_end != 1 or end < begin:
        raise MergeError(f"{doc} must hold one {BEGIN} followed by one {END}; it holds {n_begin} and {n_end}"
                         + (", in the wrong order" if n_begin == n_end == 1 else ""))
    return text[:begin + len(BEGIN)] + "\n" + body + text[end:]


def render(parts: dict[str, dict | None], finished: bool) -> str:
    """Markdown for the marker block: per part a heading, its stamp, a table and the targets it decides."""
    lines = ["Measured by `make gpu-check` (`benchmarks/gpu_suite.py --out gpu-results`) and written here from its "
             "JSON files by `make gpu-merge`; the next merge replaces everything between these markers."]
    if not finished:
        lines += ["", "**The run did not finish** (no summary.json): the part it was in when stopped may be "
                      "incomplete or missing."]
    for name, (title, render_part) in RENDERERS.items():
        data = parts[name]
        header, rows, notes, targets = render_part(data or {})  # a missing part's targets say "not measured"
        if data is None:
            rows, notes = [[f"not run (no {name}.json)"]], []
        elif isinstance(data.get("skipped"), str):  # main() found the overall budget spent before the part began
            rows, notes = [[f"not run ({data['skipped']})"]], []
        elif data.get("error"):
            rows.append([f"error: {data['error'].strip().splitlines()[-1]}"])
        lines += ["", f"### {title}", ""]
        if data is not None:
            lines += [stamp_line(data), ""]
        lines += md_table(header, rows)
        if notes:
            lines += [""] + notes
        if targets:
            lines += ["", "Targets:"] + targets
    return "\n".join(lines) + "\n"


def stamp_line(data: dict) -> str:
    env = data.get("env", {})
    try:
        when = datetime.datetime.fromisoformat(env["date"]).astimezone(datetime.timezone.utc)
        date = when.strftime("%Y-%m-%d %H:%M UTC")
    except (KeyError, TypeError, ValueError):
        date = str(env.get("date", "date unknown"))
    stamp = (f"{date}, {env.get('gpu', '?')}, driver {env.get('driver', '?')}, CUDA {env.get('cuda', '?')}, "
             f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}")
    return stamp + (", **DRY RUN (CPU, toy sizes)**" if not from_gpu(data) else "") + "."


def md_table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table; short rows (a status sentence in the first cell) are padded with empty cells."""
    def cell(c) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(c) for c in row + [""] * (len(header) - len(row))) + " |" for row in rows]


def target(label: str, value, reached, shown) -> str:
    """One target line: reached or not, with the measured number either way; "not measured" without one."""
    if value is None:
        return f"- {label}: not measured"
    return f"- {label}: {'**reached**' if reached(value) else '**not reached**'} ({shown(value)})"


def times(x: float) -> str:
    return f"{x:.3f}×"


def mib(n: int | None) -> str:
    return f"{n / 2**20:,.0f}" if n else "n/a (CPU)"


def render_tests(data: dict) -> tuple[list, list, list, list]:
    header = ["tests", "passed", "failed", "errors", "skipped", "seconds"]
    seconds = data.get("seconds") or 0
    rows = []
    if data.get("timed_out"):
        rows.append([f"cut off by its time box after {seconds:.0f} s (pytest killed; counted from its -v lines)"])
    if "tests" in data and (data["tests"] or not data.get("timed_out")):
        rows.append([data.get(k, "") for k in header[:-1]] + [f"{seconds:.0f}"])
    rows += [[f"FAILED `{name}`"] for name in data.get("failures", [])]
    command = " ".join(a for a in str(data.get("command", "")).split() if not a.startswith("--junitxml"))
    notes = [f"Command: `python {command}` (junit XML beside the JSON)."] if command else []
    return header, rows, notes, []


def render_throughput(data: dict) -> tuple[list, list, list, list]:
    header = ["loop", "batch", "tokens/s", "vs plain", "MFU", "peak MiB", "peak vs plain"]
    loops, variants = data.get("loops", {}), data.get("variants", {})
    plain = loops.get("plain", {})
    rows = []
    for name, r in {**loops, **variants}.items():
        if "tokens_per_s" not in r:
            rows.append([name, f"error: {r['error']}" if "error" in r else f"not run ({r.get('skipped')})"])
            continue
        base, peak, plain_peak = plain.get("tokens_per_s"), r.get("peak_bytes"), plain.get("peak_bytes")
        rows.append([name, r.get("batch", ""), f"{r['tokens_per_s']:,.0f}",
                     times(r["tokens_per_s"] / base) if base else "", f"{r['mfu']:.2%}", mib(peak),
                     times(peak / plain_peak) if peak and plain_peak else "n/a (CPU)" if peak is None else ""])
    rows += [[name, NOT_REACHED] for name in data.get("variants_planned", []) if name not in variants]
    notes = []
    if "shape" in data and "matmul" in data:
        sh, mm = data["shape"], data["matmul"]
        notes.append(
            f"{sh['n_layer']} layers × {sh['d_model']}, {sh['n_head']} heads, seq {sh['seq_len']}, vocabulary "
            f"{data['vocab']} (padded {data['padded_vocab']}); kiln {data['kiln_precision']}, plain "
            f"{data['plain_precision']}; compile {'on' if data.get('compile') else 'off'}; {data['steps']} steps per "
            f"loop in alternating blocks of {data['block']}, the first block warm-up. MFU against "
            f"{mm['n']}² {mm['dtype'].removeprefix('torch.')} matmuls measured on the spot, "
            f"{mm['flops_per_s'] / 1e12:,.1f} TFLOP/s. Variants are timed alone. Data: {data['data']}.")
    lean = variants.get("kiln chunked+selective", {})
    targets = [target("kiln ≥ 1.3× the plain loop's tokens/s", data.get("ratio_kiln_over_plain"),
                      lambda x: x >= 1.3, times),
               target("kiln MFU ≥ 50% of the measured matmul rate", loops.get("kiln", {}).get("mfu"),
                      lambda x: x >= 0.5, lambda x: f"{x:.2%}"),
               target("peak ≤ 0.5× the plain loop's with chunked loss + selective recompute, equal batch",
                      lean.get("peak_vs_plain"), lambda x: x <= 0.5, times)]
    return header, rows, notes, targets


def render_memory(data: dict) -> tuple[list, list, list, list]:
    header = ["model", "precision", "recompute", "predicted MiB", "measured MiB", "error"]
    points = data.get("points", [])
    rows = []
    for p in points:
        key = [p["model"], p["precision"], p["recompute"]]
        if "rel_error" in p:
            err = f"{p['rel_error']:+.2%}"
            rows.append(key + [_cell(p["predicted_bytes"] / 2**20), _cell(p["measured_bytes"] / 2**20),
                               f"**{err}**" if abs(p["rel_error"]) > 0.03 else err])
        else:
            rows.append(key + [f"error: {p['error']}" if "error" in p else f"not run ({p.get('skipped')})"])
    done = [(p["model"], p["precision"], p["recompute"]) for p in points]
    rows += [list(g) + [NOT_REACHED] for g in data.get("grid_planned", []) if tuple(g) not in done]
    measured = [p for p in points if "rel_error" in p]
    missing = len(rows) - len(measured)
    notes = [f"Predicted: `kiln.memory.estimate`'s step peak; measured: the step peak of "
             f"`kiln.memory.measure.measure_step` (`torch.cuda.max_memory_allocated`), "
             f"{data.get('steps_per_point', 3)} steps per point, the last one's peak."] if points else []
    label = "estimator within 3% of the measured peak on every grid point"
    if measured:
        worst = max(measured, key=lambda p: abs(p["rel_error"]))
        shown = (f"max |error| {abs(worst['rel_error']):.2%} at {worst['model']} {worst['precision']} "
                 f"{worst['recompute']}" + (f"; {missing} of {len(rows)} points not measured" if missing else ""))
        status = ("**not reached**" if abs(worst["rel_error"]) > 0.03 else
                  "not measured on every point" if missing else "**reached**")
        targets = [f"- {label}: {status} ({shown})"]
    else:
        targets = [f"- {label}: not measured"]
    return header, rows, notes, targets


def render_kernels(data: dict) -> tuple[list, list, list, list]:
    # benchmarks/kernels.py prints its rows without the header; use its own. Loaded by path: another `kernels`
    # (Hugging Face's kernels package, which transformers looks for, or tests/kernels) may hold the name.
    spec = importlib.util.spec_from_file_location("kiln_benchmark_kernels", ROOT / "benchmarks" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    HEADER = module.HEADER

    header = [c.strip() for c in HEADER.splitlines()[0].strip().strip("|").split("|")]
    output = str(data.get("output", ""))
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in output.splitlines() if line.startswith("| ") and line.rstrip().endswith("|")]
    if data.get("timed_out"):
        rows.append([f"cut off by its time box after {data.get('seconds') or 0:.0f} s"])
    elif data.get("returncode") not in (0, None):
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        rows.append([f"failed (exit {data['returncode']}): {last[0].strip()}"])
    elif data and not rows:
        rows.append(["no rows in benchmarks/kernels.py's output"])
    copy = [line.strip() + "; " for line in output.splitlines() if line.startswith("device-to-device copy:")]
    notes = [f"Command: `python {data['command']}` (one or two shapes per op); {''.join(copy[:1])}the full sweep "
             "and the kernel targets: the Kernels section."] if "command" in data else []
    return header, rows, notes, []


def render_profile(data: dict) -> tuple[list, list, list, list]:
    header = ["part", "ms per step", "share of the step"]
    summary = data.get("summary")
    if not summary:
        return header, [[NOT_REACHED if not data.get("error") else f"failed: {data['error'].splitlines()[-1]}"]], [], []
    rows = [[name, f"{1000 * sec:.2f}", f"{sec / summary['step_s']:.1%}"] for name, sec in summary["breakdown"].items()]
    rows.append(["step", f"{1000 * summary['step_s']:.2f}", "100%"])
    idle = summary.get("device_idle_share")
    notes = [f"{data['shape'].get('preset', 'toy shape')}, {data['precision']}: verdict **{summary['verdict']}**: "
             f"{summary['why']}" + (f"; device idle {idle:.1%} of the traced steps" if idle is not None else "")]
    notes += [f"Advice: {a}" for a in summary.get("advice", [])]
    return header, rows, notes, []


def render_fp8(data: dict) -> tuple[list, list, list, list]:
    header = ["precision", "tokens/s", "vs bf16", "peak MiB", "loss at the last step"]
    modes = data.get("modes", {})
    base = modes.get("bf16", {}).get("tokens_per_s")
    rows = []
    for mode in ("bf16", "fp8"):
        r = modes.get(mode)
        if r is None:
            rows.append([mode, NOT_REACHED])
        elif "tokens_per_s" in r:
            rows.append([mode, _cell(r["tokens_per_s"]), times(r["tokens_per_s"] / base) if base else "",
                         mib(r["peak_bytes"]), f"{r['final_loss']:.4f} (step {r['final_step']})"])
        else:
            rows.append([mode, f"not run: {r.get('error') or r.get('skipped')}"])
    shape = data.get("shape", {})
    notes = [f"{shape.get('preset', 'toy shape')}, seq {shape.get('seq_len')}, batch {shape.get('batch')}, "
             f"{data.get('steps')} steps from the same seed, timed after a {data.get('block')}-step warm-up, "
             f"torch.compile {'on' if data.get('compile') else 'off'}; torchao {data.get('torchao') or 'not installed'}."
             ] if data else []
    return header, rows, notes, []


RENDERERS = {"tests": ("GPU tests (`pytest -m gpu`)", render_tests),
             "throughput": ("Throughput: kiln vs the plain loop", render_throughput),
             "memory": ("Memory estimator vs the measured peak", render_memory),
             "kernels": ("Kernels (`benchmarks/kernels.py --quick`)", render_kernels),
             "profile": ("Profile: kiln's GPT-2 124M step (`kiln profile`)", render_profile),
             "fp8": ("fp8 (torchao float8 linears) vs bf16", render_fp8)}
assert list(RENDERERS) == list(PARTS), "every part the suite runs has a merge renderer"


def merge_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_suite.py merge",
                                 description="Write a GPU run's <part>.json files, as tables, into docs/benchmarks.md "
                                             "between the gpu-suite marker comments; the rest of the file is kept.")
    ap.add_argument("results", type=Path, help="the run's --out folder, e.g. gpu-results")
    ap.add_argument("--doc", type=Path, default=DOC, help="the markdown file to write into (docs/benchmarks.md)")
    ap.add_argument("--allow-dry-run", action="store_true",
                    help="accept --dry-run results (CPU, toy sizes); for tests, never for the real docs")
    args = ap.parse_args(argv)
    try:
        merge(args.results, args.doc, args.allow_dry_run)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    missing = [p for p in PARTS if not (args.results / f"{p}.json").exists()]
    print(f"[gpu_suite] wrote {args.results}'s tables into {args.doc} between the gpu-suite markers"
          + (f"; not run: {', '.join(missing)}" if missing else ""))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="`gpu_suite.py merge RESULTS_DIR [--doc docs/benchmarks.md]` then writes a "
                                        "run's tables into the docs (merge --help).")
    ap.add_argument("--out", default="gpu-results", help="folder for <part>.json and <part>.md")
    ap.add_argument("--budget-min", type=float, default=20.0, help="overall wall-clock budget in minutes")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, same code paths (< 60 s)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile both throughput loops and every kiln variant (--train.compile=true), as the "
                         "issue's comparison asks; --no-compile times them eager (default: compile; the dry run "
                         "times the kiln variants eager)")
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
