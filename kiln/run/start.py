"""What `kiln train` says before its first step: the model, device, precision and layout line, LoRA's trainable
share, the scaled learning rate, and why auto chose the precision, compile and CPU-linear settings.

    lines = start_lines(lm, cfg, resume)   one string per line, in the order they print
"""
from __future__ import annotations

from kiln.memory.muon_cost import newton_schulz_flops
from kiln.models.lora import lora_line
from kiln.perf.flops import stored_cpu_peak
from kiln.perf.hardware import _gflops, native_bf16, precision_notice
from kiln.precision import mode


def start_lines(lm, cfg, resume: bool) -> list[str]:
    """lm: the built LMRun; cfg: the config as given (its precision.mode may be auto)."""
    lines = []
    c, state = lm.cfg, lm.state
    tokens_per_step = c.train.micro_batch_size * c.train.grad_accum_steps * c.data.seq_len
    world = state.world
    ranks = f" | {world.strategy} × {world.size} ranks" if world.sharded else ""
    if world.plan.model_parallel or world.plan.cp > 1 or world.plan.ep > 1:
        mesh = " × ".join(f"{k}{v}" for k, v in world.plan.mesh_shape.items())
        ranks = f" | mesh {mesh} ({world.strategy})"
        ranks += f", experts over ep{world.plan.ep} of the dp ranks" if world.plan.ep > 1 else ""
    lines.append(f"model: {c.model.init or c.model.preset} ({c.model.arch}) {state.n_params / 1e6:.2f}M parameters "
                 f"| device {state.device} | precision {state.precision.mode} | {tokens_per_step * world.dp_size:,} "
                 f"tokens/step{ranks}")
    lora = lora_line(c.lora, state.model)  # the adapters' share of the parameters
    if lora:
        lines.append(lora)
    scaled = lm.peak_lr()[1]
    if scaled:
        lines.append(scaled)
    note = precision_notice(cfg.precision.mode, state.device)  # why auto chose it, or that bf16 is emulated here
    if resume and c.precision.decided_by:
        note = f"precision {c.precision.mode}, as recorded when the run started ({c.precision.decided_by})"
    if note:
        lines.append(note)
    if c.train.compile_decided_by.startswith("auto"):
        lines.append(f"train.compile {c.train.compile_decided_by}")
    cpu_fp32 = state.device.type == "cpu" and mode(c.precision.mode).plain_fp32
    if c.train.cpu_linear_decided_by.startswith("auto") and cpu_fp32:
        lines.append(f"train.cpu_linear {c.train.cpu_linear_decided_by}")
    if c.train.cpu_allocator_decided_by.startswith("auto: tuned"):
        lines.append(f"train.cpu_allocator {c.train.cpu_allocator_decided_by}")
    muon = muon_notice(state.optimizer, state.device, c.optim.muon_ns_steps)
    if muon:
        lines.append(muon)
    return lines


def muon_notice(optimizer, device, ns_steps: int) -> str | None:
    """optim.name=muon on a CPU whose bf16 products are emulated or slower than fp32: torch.optim.Muon runs its
    Newton-Schulz iterations in bf16 whatever precision.mode is, so there they can cost more than the whole
    forward and backward. The tiny preset's 24 matrices (95 GFLOP a step) took 0.21 s of one thread on a Xeon with
    AMX and 26.1 s with the same CPU capped to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2: bf16
    matmuls at 2.1 GFLOP/s); the line says so with this machine's measured rate."""
    hidden = [p for g in getattr(optimizer, "param_groups", ()) if g.get("muon") for p in g["params"]]
    if device.type != "cpu" or not hidden:
        return None
    bf16, fp32, unit = stored_cpu_peak("bf16"), stored_cpu_peak("fp32"), native_bf16()
    if unit is not None and bf16 >= fp32:
        return None
    flops = sum(newton_schulz_flops(*p.shape, ns_steps) for p in hidden)
    why = "emulated on this CPU" if unit is None else "slower than fp32 on this CPU"
    return (f"optim.name=muon: torch's Muon orthogonalises in bf16, {why} ({_gflops(bf16)} vs fp32 "
            f"{_gflops(fp32)}): its Newton-Schulz products, {flops / 1e9:.3g} GFLOP a step, take ~{flops / bf16:.3g} s "
            f"of every step here; --optim.name=adamw does without them")
