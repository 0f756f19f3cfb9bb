"""`kiln data prepare` on generated corpora: MB/s, CPU per MB, peak memory (summed PSS of the process tree) and the
speed-up of N workers over one, beside bare reads of the same files (np.frombuffer for text, json.loads per JSONL
line) and, optionally, the same prepares by another kiln checkout, interleaved run by run.

    .venv/bin/python benchmarks/data_prepare.py [--sizes 0.5,4] [--kinds jsonl,text] [--dir DIR] [--workers N]
        [--rounds R] [--before CHECKOUT] [--before-sizes 0.5] [--keep]

Each prepare runs as `python -m kiln data prepare` in a child process, sampled every 0.1 s for the PSS of it and its
workers (/proc/PID/smaps_rollup; Linux only). *MB/s (command)* is the whole command's wall clock; *MB/s (prepare)*
the prepare's own, from its meta.json (no interpreter start or imports), and the speed-up is that of N workers over
one by it. *CPU (command)* is the process tree's, interpreter start and kiln's imports (torch) included;
*CPU (prepare)* the prepare's own, this process's and its workers', from meta.json's cpu_seconds; for a kiln that
does not record it (--before), the command's less `start`, a prepare of a 2 kB corpus (shown when it is over 20% of
the start, whose own noise decides smaller ones). The ratios to the bare read and to a read + write + fsync of the
same bytes use the prepare's CPU. *load* is the 1-minute load average as the prepare began. The
corpora are written once under --dir and deleted at the end unless --keep; caches go to a fresh directory under it
and are deleted after each run. --before runs the same prepares with PYTHONPATH=CHECKOUT (e.g. a `git archive` of
the base commit) in the same rounds, alternating with this checkout, so both see the same machine load.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
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


def bare_copy(path: Path, scratch: Path) -> float:
    """CPU seconds to read every file and write it into one file beside the caches, fsynced: the floor of any
    prepare that writes its tokens (one byte per input byte), before any validation or counting."""
    out = scratch / "copy.bin"
    scratch.mkdir(parents=True, exist_ok=True)
    cpu = time.process_time()
    with out.open("wb") as w:
        for f in files_of(path):
            with f.open("rb") as r:
                while block := r.read(16 << 20):
                    w.write(block)
        w.flush()
        os.fsync(w.fileno())
    seconds = time.process_time() - cpu
    out.unlink()
    return seconds


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


def prepare(path: Path, kind: str, workers: int, cache: Path, checkout: Path) -> dict:
    """One `kiln data prepare` of `checkout` in a child process: seconds, CPU seconds of the process tree, peak PSS,
    the 1-minute load average before it, and its summary line."""
    shutil.rmtree(cache, ignore_errors=True)
    pattern = "*.jsonl" if kind == "jsonl" else "*.txt"
    cmd = [sys.executable, "-m", "kiln", "data", "prepare", f"--data.source={path}", f"--data.pattern={pattern}",
           f"--data.cache_dir={cache}", f"--data.workers={workers}"]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    # cwd: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=checkout)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_pss(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}): {out}")
    metas = [json.loads(m.read_text()) for m in cache.glob("*/meta.json")]
    inner = sum(m["seconds"] for m in metas)  # the prepare itself, without the start
    inner_cpu = sum(m.get("cpu_seconds", float("nan")) for m in metas)  # a kiln from before it has none
    shutil.rmtree(cache, ignore_errors=True)
    return {"seconds": seconds, "cpu": after.ru_utime - cpu.ru_utime + after.ru_stime - cpu.ru_stime, "peak": peak,
            "load": load, "inner": inner, "inner_cpu": inner_cpu,
            "summary": next((line for line in out.splitlines() if "summary" in line), "")}


def start_cost(root: Path, checkout: Path) -> float:
    """CPU seconds of a prepare of a 2 kB text file: the interpreter start and kiln's imports."""
    tiny = root / "tiny"
    tiny.mkdir(parents=True, exist_ok=True)
    (tiny / "t.txt").write_text("a few words of text\n" * 100)
    costs = [prepare(tiny, "text", 1, root / "cache", checkout)["cpu"] for _ in range(3)]
    return min(costs)


def cpu_model() -> str:
    """The model name (kiln.perf.measured's), with the family and model numbers /proc/cpuinfo gives beside it."""
    sys.path.insert(0, str(ROOT))
    from kiln.perf.measured import cpu_model as model  # the repository's own helper

    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    family = f", family {info['cpu family']} model {info['model']}" if "cpu family" in info else ""
    return model() + family


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5", help="corpus sizes in GB, comma-separated (e.g. 0.5,4)")
    ap.add_argument("--kinds", default="jsonl,text")
    ap.add_argument("--dir", default="/tmp/kiln-bench-data")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="the 'all cores' count")
    ap.add_argument("--rounds", type=int, default=1, help="prepares of each configuration (medians reported)")
    ap.add_argument("--before", help="another kiln checkout to run interleaved with this one")
    ap.add_argument("--before-sizes", default="0.5", help="the sizes --before runs on")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    args = ap.parse_args()
    root = Path(args.dir).expanduser()
    cores = len(os.sched_getaffinity(0))
    versions = {"this": ROOT} | ({"before": Path(args.before).resolve()} if args.before else {})
    before_sizes = {float(s) for s in args.before_sizes.split(",")}
    print(f"CPU: {cpu_model()}, {cores} cores available; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    for name, checkout in versions.items():  # each child must import the checkout it stands for
        found = subprocess.run([sys.executable, "-c", "import kiln; print(kiln.__file__)"], capture_output=True,
                               text=True, cwd=checkout, env=dict(os.environ, PYTHONPATH=str(checkout))).stdout.strip()
        if not Path(found).resolve().is_relative_to(checkout):
            raise SystemExit(f"{name}: python imports kiln from {found}, not from {checkout}")
    starts = {name: start_cost(root, checkout) for name, checkout in versions.items()}
    print("start (CPU-s of a prepare of 2 kB): " + ", ".join(f"{n} {s:.2f}" for n, s in starts.items()), flush=True)
    rows = []
    try:
        for size in (float(s) for s in args.sizes.split(",")):
            for kind in args.kinds.split(","):
                path = make_corpus(root, kind, size)
                mb = sum(f.stat().st_size for f in files_of(path)) / 1e6
                bare, bare_cpu = bare_read(path, kind)
                bare, bare_cpu = min((bare, bare_cpu), bare_read(path, kind))  # the second read: page cache warm
                copy_cpu = min(bare_copy(path, root / "cache") for _ in range(2))
                print(f"{path.name}: {mb:,.0f} MB; bare read {mb / bare_cpu:,.0f} MB/CPU-s, read + write + fsync "
                      f"{mb / copy_cpu:,.0f} MB/CPU-s", flush=True)
                runs: dict[tuple[str, int], list[dict]] = {}
                for _ in range(args.rounds):
                    for workers in (1, args.workers):
                        for name, checkout in versions.items():
                            if name != "this" and size not in before_sizes:
                                continue
                            run = prepare(path, kind, workers, root / "cache", checkout)
                            runs.setdefault((name, workers), []).append(run)
                            print(f"  {name} w={workers}: {run['seconds']:.1f} s, {run['cpu']:.1f} CPU-s, peak "
                                  f"{run['peak'] / 2**20:.0f} MiB, load {run['load']:.1f} | {run['summary']}",
                                  flush=True)
                for (name, workers), got in runs.items():
                    med = {k: statistics.median(r[k] for r in got)
                           for k in ("seconds", "cpu", "peak", "load", "inner", "inner_cpu")}
                    one = statistics.median(r["inner"] for r in runs[(name, 1)])
                    # The prepare's own CPU (meta.json) when the kiln records it, else the command's less the start.
                    own = med["inner_cpu"] if med["inner_cpu"] == med["inner_cpu"] else med["cpu"] - starts[name]
                    fine = own > 0.2 * starts[name] or med["inner_cpu"] == med["inner_cpu"]
                    rows.append([f"{kind} {mb / 1e3:.1f} GB", name, workers, f"{mb / med['seconds']:,.1f}",
                                 f"{mb / med['inner']:,.1f}", f"{one / med['inner']:.2f}×", f"{med['load']:.1f}",
                                 f"{1e3 * med['cpu'] / mb:,.2f}", f"{1e3 * own / mb:,.2f}" if fine else "–",
                                 f"{med['peak'] / 2**20:,.0f}", f"{own / bare_cpu:.2f}×" if fine else "–",
                                 f"{own / copy_cpu:.2f}×" if fine else "–"])
    finally:
        shutil.rmtree(root / "cache", ignore_errors=True)
        shutil.rmtree(root / "tiny", ignore_errors=True)
        if not args.keep:
            for size in args.sizes.split(","):
                for kind in args.kinds.split(","):
                    shutil.rmtree(root / f"{kind}-{float(size):g}GB", ignore_errors=True)
    head = ["corpus", "kiln", "workers", "MB/s (command)", "MB/s (prepare)", "speed-up (prepare)", "load",
            "CPU ms/MB (command)", "CPU ms/MB (prepare)", "peak MiB", "prepare CPU / bare read",
            "prepare CPU / read+write"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
