"""Generation tokens/s with and without the KV cache (kiln.models.generate), greedy, random-init weights.

    tiny         224 new tokens after a 32-token prompt (tiny's max_seq_len is 256: 32 + 223 fed back = 255)
    qwen3-0.6b   512 new tokens after a 32-token prompt (the issue's target: the cache ≥ 5× faster)

Cached and uncached runs alternate round by round, so that both see the same load on a shared machine; the load
average is printed before and after. Model building is not timed; the prefill is.

    .venv/bin/python benchmarks/generate.py [--model tiny|qwen3-0.6b|both] [--rounds 3] [--threads 0]
        [--device cpu] [--dtype fp32|bf16]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from kiln.models import ModelConfig, build_model
from kiln.models.generate import generate

SETUPS = {"tiny": (ModelConfig(preset="tiny", vocab_size=256), 224),
          "qwen3-0.6b": (ModelConfig(preset="qwen3-0.6b"), 512)}
PROMPT = 32


def run_once(model, prompt: list[int], new: int, use_cache: bool, device: torch.device) -> float:
    start = time.perf_counter()
    out = generate(model, [prompt], new, use_cache=use_cache, vocab_limit=model.cfg.vocab_size)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert len(out.tokens[0]) == new, (len(out.tokens[0]), out.reasons)
    return seconds


def bench(name: str, rounds: int, device: torch.device, dtype: torch.dtype) -> dict:
    cfg, new = SETUPS[name]
    torch.manual_seed(0)
    model = build_model(cfg, device).to(dtype).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    run_once(model, prompt, 4, True, device)  # warm-up: first-call allocations and kernel selection
    times = {"cache": [], "no_cache": []}
    load_before = os.getloadavg()
    for _ in range(rounds):
        times["cache"].append(run_once(model, prompt, new, True, device))
        times["no_cache"].append(run_once(model, prompt, new, False, device))
    cached, plain = statistics.median(times["cache"]), statistics.median(times["no_cache"])
    return {"model": name, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "prompt": PROMPT, "new_tokens": new, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "threads": torch.get_num_threads(), "rounds": rounds,
            "cache_tokens_per_s": round(new / cached, 1), "no_cache_tokens_per_s": round(new / plain, 1),
            "speedup": round(plain / cached, 2), "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
            "load_before": [round(x, 1) for x in load_before], "load_after": [round(x, 1) for x in os.getloadavg()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*SETUPS, "both"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    for name in (SETUPS if args.model == "both" else [args.model]):
        print(json.dumps(bench(name, args.rounds, device, dtype)), flush=True)


if __name__ == "__main__":
    main()
