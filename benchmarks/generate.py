"""Generation tokens/s with and without the KV cache (kiln.models.generate), greedy, random-init weights.

    tiny         224 new tokens after a 32-token prompt (tiny's max_seq_len is 256: 32 + 223 fed back = 255)
    qwen3-0.6b   512 new tokens after a 32-token prompt (the issue's target: the cache ≥ 5× faster)

Cached and uncached runs alternate round by round, so that both see the same load on a shared machine; the load
average is printed before and after. Model building is not timed; the prefill is.

    .venv/bin/python benchmarks/generate.py [--model tiny|qwen3-0.6b|both] [--rounds 3] [--threads 0]
        [--device cpu] [--dtype fp32|bf16] [--project-uncached]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from kiln.models import ModelConfig, build_model
from kiln.models.generate import generate

SETUPS = {"tiny": (ModelConfig(preset="tiny", vocab_size=256), 224),
          "qwen3-0.6b": (ModelConfig(preset="qwen3-0.6b"), 512)}
PROMPT = 32


def run_once(model, prompt: list[int], new: int, use_cache: bool, device: torch.device) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on a shared CPU the CPU time is what the work took, the wall
    time also how long the scheduler kept it waiting."""
    start, cpu = time.perf_counter(), time.process_time()
    out = generate(model, [prompt], new, use_cache=use_cache, vocab_limit=model.cfg.vocab_size)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert len(out.tokens[0]) == new, (len(out.tokens[0]), out.reasons)
    return seconds, cpu


@torch.no_grad()
def project_uncached(model, prompt: list[int], new: int, points: int = 5) -> tuple[float, float, list]:
    """(wall, CPU) seconds of the uncached run projected from one forward at `points` context lengths spread over
    the run's (a quadratic in the length fitted through them, summed over its `new` steps): for a model whose full
    uncached run does not fit the session. Each forward is what the uncached path runs at that step."""
    lengths = [round(len(prompt) + i * (new - 1) / (points - 1)) for i in range(points)]
    ids = torch.randint(0, model.cfg.vocab_size, (lengths[-1],), generator=torch.Generator().manual_seed(1))
    measured = []
    for T in lengths:
        start, cpu = time.perf_counter(), time.process_time()
        torch.nn.functional.linear(model.hidden(ids[None, :T])[:, -1], model.head_weight)
        measured.append((T, time.perf_counter() - start, time.process_time() - cpu))
    steps = torch.arange(len(prompt), len(prompt) + new, dtype=torch.float64)
    total = []
    for column in (1, 2):
        x = torch.tensor([m[0] for m in measured], dtype=torch.float64)
        y = torch.tensor([m[column] for m in measured], dtype=torch.float64)
        coef = torch.linalg.lstsq(torch.stack([x ** 0, x, x ** 2], 1), y[:, None]).solution[:, 0]
        total.append(float((coef[0] + coef[1] * steps + coef[2] * steps ** 2).sum()))
    return total[0], total[1], [(T, round(w, 3), round(c, 3)) for T, w, c in measured]


def bench(name: str, rounds: int, device: torch.device, dtype: torch.dtype, project: bool = False) -> dict:
    cfg, new = SETUPS[name]
    torch.manual_seed(0)
    model = build_model(cfg, device).to(dtype).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    run_once(model, prompt, 4, True, device)  # warm-up: first-call allocations and kernel selection
    times, cpu = {"cache": [], "no_cache": []}, {"cache": [], "no_cache": []}
    load_before = os.getloadavg()
    projected = None
    for r in range(rounds):
        for key in times:
            if key == "no_cache" and project:
                wall, used, projected = project_uncached(model, prompt, new)
            else:
                wall, used = run_once(model, prompt, new, key == "cache", device)
            times[key].append(wall)
            cpu[key].append(used)
            print(f"{name} round {r + 1} {key}: {wall:.2f} s wall, {used:.2f} s CPU, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
    cached, plain = statistics.median(times["cache"]), statistics.median(times["no_cache"])
    cached_cpu, plain_cpu = statistics.median(cpu["cache"]), statistics.median(cpu["no_cache"])
    return {"model": name, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "prompt": PROMPT, "new_tokens": new, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "threads": torch.get_num_threads(), "rounds": rounds,
            "cache_tokens_per_s": round(new / cached, 1), "no_cache_tokens_per_s": round(new / plain, 1),
            "speedup": round(plain / cached, 2), "speedup_cpu_time": round(plain_cpu / cached_cpu, 2),
            "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
            "cpu_seconds": {k: [round(t, 2) for t in v] for k, v in cpu.items()},
            "no_cache_projected_from": projected,
            "load_before": [round(x, 1) for x in load_before], "load_after": [round(x, 1) for x in os.getloadavg()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*SETUPS, "both"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--project-uncached", action="store_true",
                   help="project the uncached run from forwards at 5 context lengths instead of running it whole")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    for name in (SETUPS if args.model == "both" else [args.model]):
        print(json.dumps(bench(name, args.rounds, device, dtype, args.project_uncached)), flush=True)


if __name__ == "__main__":
    main()
