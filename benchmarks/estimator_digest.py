"""Print every number the estimator, the planner's step-time model and the FLOP counter give for a grid of
presets and levers, one JSON line per case: run it on two trees and diff the outputs to show a refactor changed
none of them (docs/models.md). No timing, no device: pure arithmetic, a few seconds on a CPU.

    PYTHONPATH=<tree> python benchmarks/estimator_digest.py > digest.jsonl
"""
from __future__ import annotations

import itertools
import json
from dataclasses import replace

from kiln.memory.devices import get_device
from kiln.memory.estimate import Job, Target, estimate, recompute_plan
from kiln.memory.planner import search, step_time
from kiln.models import ModelConfig, param_count
from kiln.perf.flops import flops_per_token, recompute_flops_per_token

PRESETS = ["nano", "tiny", "gpt2-124m", "gpt2-350m", "llama-125m", "llama-1b", "llama-7b"]
LEVERS = [
    dict(precision="fp32"), dict(precision="bf16"), dict(precision="bf16-master"),
    dict(precision="bf16", recompute="full"), dict(precision="bf16", recompute="selective"),
    dict(precision="bf16", recompute="every_k"), dict(precision="bf16", chunked_loss=512),
    dict(precision="fp32", optimizer="adamw8bit", grad_accum=4), dict(precision="bf16", offload=True),
    dict(precision="bf16", optimizer_offload="host"), dict(precision="bf16", parallel="fsdp", world=4),
    dict(precision="bf16", parallel="zero1", world=8), dict(precision="bf16", parallel="ddp", world=2),
]


def model(preset: str, dropout: float) -> ModelConfig:
    return ModelConfig(preset=preset, vocab_size=256 if preset in ("nano", "tiny") else 0,
                       dropout=dropout).resolve()


def main() -> None:
    h100 = get_device("H100")
    for preset, dropout, levers, target in itertools.product(PRESETS, (0.0, 0.1), LEVERS, ("cuda", "cpu")):
        cfg = model(preset, dropout)
        kw = dict(levers)
        policy = kw.pop("recompute", "none")
        offload = kw.pop("offload", False)
        T = min(cfg.max_seq_len, 1024)
        job = Job(model=cfg, micro_batch=2, seq_len=T, target=Target(target, 9.0), **kw,
                  recompute=recompute_plan(policy, cfg.n_layer, 2),
                  offload=frozenset(range(0, cfg.n_layer, 2)) if offload else frozenset())
        b = estimate(job)
        out = {"case": [preset, dropout, levers, target], "param_count": param_count(cfg), "total": b.total_bytes,
               "components": b.components, "phase": b.peak_phase, "host": b.host, "saved": b.activations_saved,
               "per_block": b.per_block, "model_state": b.model_state, "first": b.first_step_peak,
               "timeline": b.timeline, "recompute_flops": b.recompute_flops, "backend": b.backend,
               "flops_per_token": flops_per_token(cfg, T),
               "recompute_flops_per_token": recompute_flops_per_token(cfg, T, job.recompute)}
        if target == "cuda":
            out["step_time"] = step_time(job, h100)
        print(json.dumps(out, sort_keys=True))
    for preset in ("gpt2-124m", "llama-125m", "llama-1b"):
        cfg = model(preset, 0.0)
        from kiln.config import Config  # lazy: a script, the config is only needed for the planner's search
        c = Config()
        c.model = replace(c.model, preset=preset)
        c.data = replace(c.data, tokenizer="gpt2") if hasattr(c.data, "tokenizer") else c.data
        plan = search(c, h100, 40 * 2**30, 2**19)
        print(json.dumps({"plan": preset, "result": plan.to_json()}, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
