"""`kiln plan [CONFIG.toml] [overrides] --memory 24GiB [--global-batch-tokens N] [--device NAME] [--json]
[--verify]`: the fastest configuration predicted to fit."""
from __future__ import annotations

import json
from dataclasses import replace

import torch

from kiln.cli.common import add_config_arguments, config_from
from kiln.cli.memory import _device
from kiln.config import ConfigError, apply_overrides, checked
from kiln.memory.estimate import GiB, fmt_bytes, local_parameter_shapes, parse_bytes, peak_allocated
from kiln.memory.muon_cost import muon_cost, muon_line
from kiln.memory import calibrate as calibration
from kiln.memory.levers import JobSections, job_for, precision_for
from kiln.memory.planner import fit_time_model, search, time_constants
from kiln.models.registry import family
from kiln.parallel.layout import check_ep_ranks, check_experts
from kiln.parallel.strategy import strategy
from kiln.perf.hardware import native_bf16
from kiln.precision import mode
from kiln.train.optim import scaled_lr
from kiln.run.measure import measure_step


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="search memory levers for the fastest configuration that fits",
                       description="Search precision × micro-batch × accumulation × recompute × offload × 8-bit "
                                   "optimizer × chunked loss for CONFIG; rank what fits by predicted step time.")
    add_config_arguments(p)
    p.add_argument("--memory", default="", help="memory to fit in, e.g. 24GiB or 80GB (default: the device's)")
    p.add_argument("--global-batch-tokens", type=int, default=0,
                   help="tokens per optimizer step (default: micro_batch_size × grad_accum_steps × seq_len)")
    p.add_argument("--device", default="", help="H100, H200, A100-80GB, A100-40GB, V100-32GB, L4, RTX 4090 or cpu "
                                                "(default: this machine's)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs sharing the global batch: also search the layout "
                                                     "(parallel.tp × pp × cp, the rest data parallel under ddp, "
                                                     "zero1 or fsdp); --memory is per GPU")
    p.add_argument("--interconnect", default="nvlink4", help="link between the GPUs of a node for the collectives' "
                                                             "time: nvlink4, pcie4, pcie5 or ib-ndr")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node: tensor parallelism stays within one; "
                                                              "groups spanning nodes use --inter-node")
    p.add_argument("--inter-node", default="ib-ndr", help="link between nodes, per GPU (default ib-ndr, 50 GB/s)")
    p.add_argument("--no-model-parallel", action="store_true", help="search data parallelism only (no tp, pp, cp)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    p.add_argument("--json", action="store_true", help='print {"best": {...}, "candidates": [...]}')
    p.add_argument("--calibrate", action="store_true", help="first measure this device's matmul and bandwidth "
                                                            "efficiency and per-op cost, and keep them for later plans")
    p.add_argument("--verify", type=int, nargs="?", const=3, default=0, metavar="K",
                   help="run a few steps of the top K candidates here and print predicted vs measured peak")


def _row(i, c, gpus: int) -> str:
    o, comp = c.overrides, c.breakdown.components
    strategy = f"{c.choice.layout(gpus):<22}{o['parallel.strategy']:<7}" if gpus > 1 else ""
    state = sum(comp[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states"))
    optim = o["optim.name"] + ("+host" if o["optim.offload"] != "none" else "")
    rec = o["memory.recompute"] + ("*" if o["memory.recompute"] == "budget" else "")
    return (f"{i:>3} {strategy}{o['precision.mode']:<12}{o['train.micro_batch_size']:>4}×{o['train.grad_accum_steps']:<4}"
            f"{rec:<11}{o['memory.offload_blocks']:<6}{optim:<15}{o['memory.chunked_loss'] or '-':>6}"
            f"{state / GiB:>8.2f}{comp['activations'] / GiB:>8.2f}{(comp['logits'] + comp['temporaries']) / GiB:>8.2f}"
            f"{c.total_bytes / GiB:>8.2f}{c.step_s:>10.4g}")


def run(args, overrides) -> int:
    cfg = config_from(args, overrides)
    device = _device(args.device)
    if args.calibrate:
        here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if args.device and device.kind != here.type:
            raise ConfigError(f"--calibrate measures this machine's {here.type}; drop --device={args.device}")
        model = _calibrate(cfg, device, here)
        path = calibration.save(device, model)
        device = replace(device, time_model=model)
        print(f"calibrated {device.name}: matmuls reach {model['matmul_efficiency']:.0%} of the peak, elementwise "
              f"{model['bandwidth_efficiency']:.0%} of the bandwidth, {1e6 * model['op_overhead_s']:.1f} µs per op "
              f"(kept in {path})")
    memory = parse_bytes(args.memory, "--memory") if args.memory else None
    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--gpus and --gpus-per-node must be ≥ 1, got {args.gpus} and {args.gpus_per_node}")
    sections = JobSections.of(cfg)
    if cfg.parallel.ep > 1:  # a given ep: the line `kiln train` and `kiln memory` print for the same layout
        model = sections.resolved_model()
        check_experts(cfg.parallel.ep, model, family(model.arch))
        check_ep_ranks(cfg.parallel, args.gpus)
    plan = search(sections, device, memory, args.global_batch_tokens, args.gpus, args.interconnect,
                  model_parallel=not args.no_model_parallel, gpus_per_node=args.gpus_per_node,
                  inter_node=args.inter_node)
    if args.json:
        out = plan.to_json()
        out["device_peak_flops"] = dict(device.peak_flops)
        if args.verify:
            out["verify"] = _verify(cfg, plan, args.verify, quiet=True)
        print(json.dumps(out, indent=2))
        return 0 if plan.best else 1
    print(f"{cfg.model.preset}: {plan.global_sequences} sequences × {plan.seq_len} tokens per step on {device.name}, "
          f"{fmt_bytes(plan.memory)}: {plan.considered} configurations considered, {len(plan.candidates)} fit")
    if device.kind == "cpu":
        print(_cpu_rates(device))
    me, be, op_s, source = time_constants(device)
    print(f"time model ({source}{'' if device.time_model else ': kiln plan --calibrate measures them'}): matmuls at "
          f"{me:.0%} of peak, elementwise at {be:.0%} of bandwidth, {1e6 * op_s:.1f} µs per op")
    if not plan.best:
        print(plan.shortfall())
        return 1
    if args.gpus > 1:
        print("layout: pp·dp·cp·tp (tp innermost, within a node); sp = sequence parallel; 1f1b / i1f1b (interleaved) "
              "/ m = pipeline micro-batches; cp is modelled as ring attention (training all-gathers k/v, tp = pp = 1); "
              "peak and step s are the "
              "worst pipeline stage's, modelled (docs/parallel.md)")
    layout = f"{'layout':<22}{'strat':<7}" if args.gpus > 1 else ""
    print(f"{'#':>3} {layout}{'precision':<12}{'mb×acc':<9}{'recompute':<11}{'offl':<6}{'optimizer':<15}{'chunk':>6}"
          f"{'state':>8}{'acts':>8}{'logit+t':>8}{'total':>8}{'step s':>10}   (GiB)")
    for i, c in enumerate(plan.candidates[: args.top], 1):
        print(_row(i, c, args.gpus))
    # context parallelism is modelled as ring attention, which kiln does not train (it all-gathers k and v, with
    # tp = pp = 1: docs/parallel.md): the recommendation is the fastest layout whose model is what training runs
    best = next((c for c in plan.candidates if c.choice.cp == 1), None)
    if best is None:
        print("every fitting layout needs context parallelism, modelled here as ring attention, which kiln does "
              "not train (docs/parallel.md)")
        return 1
    if best is not plan.best:
        print(f"note: #1 uses context parallelism (parallel.cp), modelled as ring attention; recommended is the "
              f"fastest without it")
    if best.choice.optimizer == "muon":  # its Newton-Schulz products, which AdamW does not pay
        job = job_for(sections, device)
        print(muon_line(best.times, muon_cost(local_parameter_shapes(job), job.muon_ns_steps)))
    flags = " ".join(f"--{k}={v}" for k, v in best.overrides.items()
                     if v not in ("", None) and not (k == "parallel.strategy" and not strategy(v).reduces))
    nodes = -(-args.gpus // args.gpus_per_node)
    per_node = args.gpus // nodes
    launch = ("kiln train" if args.gpus == 1 else f"torchrun --nproc_per_node={per_node} -m kiln train" if nodes == 1
              else f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --rdzv-endpoint=HOST:PORT -m kiln train")
    print(f"recommended: {launch} {args.config or ''} {flags}".replace("  ", " "))
    if cfg.optim.lr_scaling != "none":  # the batch it recommends sets the learning rate too
        o = best.overrides
        dp = args.gpus // (best.choice.tp * best.choice.pp * best.choice.cp)
        tokens = o["train.micro_batch_size"] * o["train.grad_accum_steps"] * plan.seq_len * dp
        print(f"  {scaled_lr(cfg.optim, tokens)[1]}")
    if args.gpus == 1:
        print(f"  or: kiln train --plan.memory={args.memory or fmt_bytes(plan.memory).replace(' ', '')}"
              + (f" --plan.device={args.device}" if args.device else ""))
    if args.verify:
        _verify(cfg, plan, args.verify, quiet=False)
    return 0


# Two steps of the same shape at micro-batch 1 and 8: one mostly per-op cost, one mostly matmuls.
CALIBRATION_SHAPE = ["--model.preset=tiny", "--model.n_layer=2", "--model.d_model=256", "--model.n_head=4",
                     "--model.max_seq_len=128", "--data.seq_len=128", "--train.grad_accum_steps=1"]


def _calibrate(cfg, device, here) -> dict:
    """Microbenchmarks for the bandwidth, then the matmul efficiency and per-op seconds fitted to real steps."""
    precision = precision_for(cfg.precision.mode, device)
    model = calibration.measure(device, here, precision)
    observations = []
    for micro in (1, 8):
        trial = apply_overrides(cfg, {"train.micro_batch_size": micro})
        trial = apply_overrides(trial, dict(o.lstrip("-").split("=") for o in CALIBRATION_SHAPE))
        m = measure_step(trial, here, steps=4)
        observations.append((job_for(JobSections.of(trial), device), min(m.step_seconds[1:])))
    model.update(fit_time_model(device, observations, model["bandwidth_efficiency"]))
    return model


def _cpu_rates(device) -> str:
    """The measured matmul rates the ranking rests on, and whether bf16 is native here."""
    unit = native_bf16()
    rates = ", ".join(f"{p} {r / 1e9:.3g}" + (f" ({unit or 'emulated'})" if p == mode("bf16").peak else "")
                      for p, r in device.peak_flops.items())
    return f"matmul GFLOP/s measured on this CPU: {rates}"


def _verify(cfg, plan, k: int, quiet: bool) -> list[dict]:
    """Train a few steps of the top k candidates on this machine: predicted vs measured peak and step time."""
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    if not quiet:
        what = "max_memory_allocated" if here.type == "cuda" else "live tensor bytes"
        print(f"verify on {here.type} (3 steps each; peak = {what}):")
    for i, c in enumerate(plan.candidates[:k], 1):
        trial = checked(replace(cfg, **c.choice.on(JobSections.of(cfg)).levers()))
        m = measure_step(trial, here, steps=3)
        pred = peak_allocated(c.breakdown)
        row = {"rank": i, "overrides": c.overrides, "predicted_peak_bytes": pred, "measured_peak_bytes": m.peak_bytes,
               "predicted_step_s": c.step_s, "measured_step_s": min(m.step_seconds[1:] or m.step_seconds)}
        rows.append(row)
        if not quiet:
            print(f"  #{i}: peak predicted {fmt_bytes(pred)}, measured {fmt_bytes(m.peak_bytes)} "
                  f"({100 * (pred / m.peak_bytes - 1):+.1f}%); step predicted {c.step_s:.3g} s, measured "
                  f"{row['measured_step_s']:.3g} s")
    return rows
