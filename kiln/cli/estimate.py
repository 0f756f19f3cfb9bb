"""`kiln estimate [CONFIG.toml] [overrides] --tokens N|--chinchilla --device NAME [--gpus K]
[--mfu X | --from-run RUN_DIR | --gpu-hours H] [--price USD] [--pue P] [--json]`: a whole training run's FLOPs,
time, GPU-hours, energy and cost, every assumption printed."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from kiln.cli.common import add_config_arguments, config_from
from kiln.config import ConfigError, load_config
from kiln.memory.devices import get_device
from kiln.memory.levers import JobSections, job_for, precision_for
from kiln.models.config import param_count
from kiln.perf.estimate import (CHINCHILLA_TOKENS_PER_PARAM, duration, implied_mfu, parse_count,
                                training_estimate)

def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


DEFAULT_MFU = 0.4  # what a well-tuned dense transformer run reaches on current GPUs; said as an assumption


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="time, GPU-hours, energy and cost of a whole training run",
                       description="time = FLOPs / (GPUs × peak FLOP/s × MFU), with FLOPs = 6 per matmul parameter "
                                   "per token plus attention, for CONFIG's model trained on --tokens tokens.")
    add_config_arguments(p)
    tokens = p.add_mutually_exclusive_group(required=True)
    tokens.add_argument("--tokens", help="training tokens, e.g. 2e12, 2T, 300B")
    tokens.add_argument("--chinchilla", action="store_true",
                        help=f"{CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter (Hoffmann et al. 2022)")
    p.add_argument("--device", required=True, help="H100, H200, A100-80GB, A100-40GB, V100-32GB, L4, RTX 4090, cpu")
    p.add_argument("--gpus", type=int, default=1, help="devices training together")
    mfu = p.add_mutually_exclusive_group()
    mfu.add_argument("--mfu", type=float, help=f"model FLOPs utilisation, 0-1 (default {DEFAULT_MFU}, assumed)")
    mfu.add_argument("--from-run", metavar="RUN_DIR", help="the MFU measured by a kiln run (its metrics.jsonl; "
                                                          "its config too, when no CONFIG is given)")
    mfu.add_argument("--gpu-hours", help="the GPU-hours a run reported: estimate the MFU they imply")
    p.add_argument("--price", type=float, help="USD per GPU-hour, for the cost")
    p.add_argument("--pue", type=float, default=1.0, help="power usage effectiveness of the facility (default 1.0: "
                                                          "the devices' own power only)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


def measured_mfu(run_dir: Path) -> tuple[float, str]:
    """The median MFU over the second half of a run's train records, and where it was measured."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"--from-run {run_dir}: no metrics.jsonl; is it a kiln run directory?")
    values = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a run still writing
        if record.get("kind") == "train" and isinstance(record.get("mfu"), (int, float)):
            values.append(record["mfu"])
    if not values:
        raise ConfigError(f"--from-run {run_dir}: its metrics hold no MFU (a model kiln cannot count FLOPs for, or "
                          f"no step logged yet); give --mfu")
    half = values[len(values) // 2:]
    return statistics.median(half), f"median of the last {len(half)} logged intervals of {run_dir}"


def run(args, overrides) -> int:
    if args.from_run and not args.config and (Path(args.from_run) / "config.toml").is_file():
        args.config = Path(args.from_run) / "config.toml"
    cfg = config_from(args, overrides)
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be ≥ 1, got {args.gpus}")
    if args.price is not None and not args.price >= 0:
        raise ConfigError(f"--price must be ≥ 0 USD per GPU-hour, got {args.price}")
    device = get_device(args.device)
    precision = precision_for(cfg.precision.mode, device)
    sections = JobSections.of(cfg)
    model = sections.resolved_model()
    params = param_count(model)
    tokens = CHINCHILLA_TOKENS_PER_PARAM * params if args.chinchilla else parse_count(args.tokens, "--tokens")
    peak = device.flops(precision)
    if args.mfu is not None:
        mfu, mfu_from = args.mfu, "given (--mfu)"
    elif args.from_run:
        mfu, mfu_from = measured_mfu(Path(args.from_run))
        run_cfg = load_config(Path(args.from_run) / "config.toml") if (Path(args.from_run) / "config.toml").is_file() \
            else None
        if run_cfg is not None and run_cfg.train.device not in ("auto", device.kind) and device.kind != "cpu":
            mfu_from += f" (measured on {run_cfg.train.device}, applied to {device.name})"
    elif args.gpu_hours:
        mfu, mfu_from = None, None
    else:
        mfu, mfu_from = DEFAULT_MFU, "assumed (give --mfu, or --from-run RUN_DIR for a measured one)"
    recompute = job_for(sections, device).recompute
    if mfu is None:  # --gpu-hours: what the reported run implies
        gpu_hours = parse_count(args.gpu_hours, "--gpu-hours")
        flops = training_estimate(model, params, cfg.data.seq_len, tokens, args.gpus, peak, 1.0).flops
        mfu, mfu_from = implied_mfu(flops, gpu_hours, peak), f"implied by {gpu_hours:,.0f} GPU-hours (--gpu-hours)"
    e = training_estimate(model, params, cfg.data.seq_len, tokens, args.gpus, peak, mfu, device.power_w, args.pue,
                          args.price, recompute)
    if args.json:
        print(json.dumps(e.to_json() | {"device": device.name, "precision": precision, "mfu_from": mfu_from},
                         indent=2))
        return 0
    L, T = model.n_layer, cfg.data.seq_len
    print(f"model: {cfg.model.preset} ({model.arch}), {params / 1e6:,.1f}M parameters, seq {T}, "
          f"vocabulary {model.vocab_size} (padded {model.padded_vocab})")
    print(f"tokens: {tokens:.4g}" + (f" ({CHINCHILLA_TOKENS_PER_PARAM} × parameters, Chinchilla)"
                                      if args.chinchilla else ""))
    print(f"FLOPs = (6 × matmul parameters + 12 × layers × seq × attention width) × tokens = (6 × "
          f"{(e.flops / tokens - 12 * L * T * model.n_head * model.head_dim) / 6:.4g} + 12 × {L} × {T} × "
          f"{model.n_head * model.head_dim}) × {tokens:.4g} = {e.flops:.4g}")
    if e.hardware_flops > e.flops:
        print(f"  with recomputation ({cfg.memory.recompute}): {e.hardware_flops:.4g} executed (HFU counts these; "
              f"the time below uses MFU, which already pays for them)")
    print(f"device: {args.gpus} × {device.name}, {precision} peak {peak / 1e12:,.4g} TFLOP/s each"
          + (f", {device.power_w:g} W" if device.power_w else ""))
    print(f"MFU: {mfu:.1%}, {mfu_from}")
    print(f"time = FLOPs / (GPUs × peak × MFU) = {e.flops:.4g} / ({args.gpus} × {peak:.4g} × {mfu:.3g}) = "
          f"{e.seconds:,.0f} s = {duration(e.seconds)}")
    print(f"GPU-hours: {_n(e.gpu_hours)}")
    if e.energy_kwh is not None:
        print(f"energy = power × GPU-hours × PUE = {device.power_w:g} W × {_n(e.gpu_hours)} h × {args.pue:g} = "
              f"{_n(e.energy_kwh)} kWh (board power at its rating: an upper bound for the devices alone)")
    else:
        print(f"energy: not estimated ({device.name} has no rated power in kiln's table)")
    if e.cost is not None:
        print(f"cost = GPU-hours × price = {_n(e.gpu_hours)} × ${args.price:g} = ${e.cost:,.2f}")
    return 0
