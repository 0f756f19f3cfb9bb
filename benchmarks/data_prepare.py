"""`kiln data prepare` on generated corpora: MB/s, peak memory (summed PSS of the process tree) and the speed-up of
all cores over one worker, beside a bare read of the same files (np.frombuffer for text, json.loads per JSONL line).

    .venv/bin/python benchmarks/data_prepare.py [--sizes 0.5,4] [--kinds jsonl,text] [--dir DIR] [--workers N]

Each prepare runs as `python -m kiln data prepare` in a child process, sampled every 0.1 s for the PSS of it and its
workers (/proc/PID/smaps_rollup; Linux only). The corpora are written once under --dir and reused; caches go to a
fresh directory under it each run and are deleted after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in a is that for it as was with be by on not he i this are or his from at which but have an "
         "they you were her she there one all we their been has would when if more no out so said what up its about "
         "into than them can only other new some could time these two may then do first any my now such like our over "
         "man me even most made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still own see men work long "
         "get here between both life being under never day same another know while last might us great old year off "
         "come since against go came right used take three tokenizer gradient transformer attention").split()


def make_block(kind: str, target: int, seed: int) -> bytes:
    """About `target` bytes of records (jsonl) or lines (text) of Zipf-distributed words."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(WORDS))]
    out, size, i = [], 0, 0
    while size < target:
        n = rng.randint(40, 400)
        text = " ".join(rng.choices(WORDS, weights, k=n)) + f". document {seed}-{i}"
        line = (json.dumps({"text": text, "id": i}) if kind == "jsonl" else text) + "\n"
        out.append(line)
        size += len(line)
        i += 1
    return "".join(out).encode()


def make_corpus(root: Path, kind: str, gigabytes: float) -> Path:
    """jsonl: files of 256 MB; text: files of 16 MB (each file is one document). Written once, then reused."""
    path = root / f"{kind}-{gigabytes:g}GB"
    done = path / "COMPLETE"
    if done.is_file():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    total, per_file = int(gigabytes * 1e9), (256 << 20) if kind == "jsonl" else (16 << 20)
    blocks = [make_block(kind, 4 << 20, s) for s in range(4)]
    written, index = 0, 0
    while written < total:
        name = path / (f"part-{index:04d}.jsonl" if kind == "jsonl" else f"part-{index:04d}.txt")
        with name.open("wb") as f:
            size = 0
            while size < min(per_file, total - written):
                block = blocks[(index + size // len(blocks[0])) % len(blocks)]
                # A per-block marker keeps documents distinct (the split hashes them) without regenerating text.
                marker = (json.dumps({"text": f"block {index}-{size}", "id": -1}) + "\n" if kind == "jsonl"
                          else f"block {index}-{size}\n").encode()
                f.write(marker + block)
                size += len(marker) + len(block)
            written += size
        index += 1
    done.write_text("")
    return path


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".txt"))


def bare_read(path: Path, kind: str) -> tuple[float, float]:
    """(seconds, CPU seconds) to read every file and turn it into bytes tokens (text) or parse every line (jsonl)."""
    start, cpu = time.perf_counter(), time.process_time()
    for f in files_of(path):
        if kind == "text":
            np.frombuffer(f.read_bytes(), dtype=np.uint8)
        else:
            with f.open("rb") as fh:
                for line in fh:
                    json.loads(line)
    return time.perf_counter() - start, time.process_time() - cpu


def tree_pss(pid: int) -> int:
    """Summed PSS (bytes) of pid and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def prepare(path: Path, kind: str, workers: int, cache: Path) -> tuple[float, int, str, float]:
    """(seconds, peak PSS bytes, summary line, CPU seconds of the process tree) of one `kiln data prepare` in a child
    process. The CPU seconds are the figure to compare on a shared machine: wall time there depends on the others."""
    shutil.rmtree(cache, ignore_errors=True)
    pattern = "*.jsonl" if kind == "jsonl" else "*.txt"
    cmd = [sys.executable, "-m", "kiln", "data", "prepare", f"--data.source={path}", f"--data.pattern={pattern}",
           f"--data.cache_dir={cache}", f"--data.workers={workers}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_pss(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime - cpu.ru_utime + after.ru_stime - cpu.ru_stime
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}): {out}")
    shutil.rmtree(cache, ignore_errors=True)
    return seconds, peak, next((l for l in out.splitlines() if "summary" in l), ""), cpu_s


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5", help="corpus sizes in GB, comma-separated (e.g. 0.5,4)")
    ap.add_argument("--kinds", default="jsonl,text")
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "kiln-bench-data"))
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="the 'all cores' count")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    args = ap.parse_args()
    root = Path(args.dir).expanduser()
    cores = len(os.sched_getaffinity(0))
    print(f"CPU: {cpu_model()}, {cores} cores available; load average at start {os.getloadavg()[0]:.1f}")
    print("wall: MB/s of the whole command (process start and imports included); cpu: MB per CPU-second of the "
          "process tree; peak: summed PSS")
    print(f"{'corpus':<14}{'bare wall':>10}{'bare cpu':>10}{'w=1 wall':>10}{'w=1 cpu':>9}{'peak':>10}"
          f"{f'w={args.workers} wall':>10}{'cpu':>8}{'peak':>10}{'speed-up':>10}{'cpu/bare':>10}")
    for size in (float(s) for s in args.sizes.split(",")):
        for kind in args.kinds.split(","):
            path = make_corpus(root, kind, size)
            mb = sum(f.stat().st_size for f in files_of(path)) / 1e6
            bare, bare_cpu = bare_read(path, kind)
            t1, p1, line1, c1 = prepare(path, kind, 1, root / "cache")
            tn, pn, linen, cn = prepare(path, kind, args.workers, root / "cache")
            print(f"{path.name:<14}{mb / bare:>10.1f}{mb / bare_cpu:>10.1f}{mb / t1:>10.1f}{mb / c1:>9.1f}"
                  f"{p1 / 2**20:>6.0f} MiB{mb / tn:>10.1f}{mb / cn:>8.1f}{pn / 2**20:>6.0f} MiB{t1 / tn:>9.2f}x"
                  f"{c1 / bare_cpu:>9.2f}x", flush=True)
            print(f"    w=1: {line1.removeprefix('data: ')}\n    w={args.workers}: {linen.removeprefix('data: ')}")
            if not args.keep:
                shutil.rmtree(path)


if __name__ == "__main__":
    main()
