"""What a device cannot honour among the levers a config sets, found before anything is built:

    notes = device_levers(cfg, device)   a ValueError (one line, the fix) for a setting that cannot run here;
                                         one line each, returned for the run to print at start, for those that run
                                         and do nothing useful here (no silent no-ops)

    refuse_before_data(cfg)              the preset's shape against lora.targets and parallel.cp, in one line each

`kiln train` (through build_lm) and `kiln.fit` call device_levers first; build_lm then refuse_before_data.
"""
from __future__ import annotations

import torch

from kiln.config import Config
from kiln.errors import KilnError
from kiln.models.lora import resolve_targets
from kiln.models.registry import family
from kiln.parallel.context import check_context_parallel
from kiln.perf.hardware import resolve_kernels


def device_levers(cfg: Config, device: torch.device) -> list[str]:
    """The levers `device` cannot honour, found before anything is built: a ValueError (one line, the fix) for a
    setting that cannot run here, and one line each, returned for the run to print, for those that run and do
    nothing useful here (no silent no-ops).

    On a CPU the device's memory is the host's: parallel.cpu_offload is refused (FSDP2 would move nothing, and its
    offload pins memory, which fails without an accelerator: "Cannot access accelerator device"), while
    memory.offload_blocks (skipped by the model pipeline) and optim.offload (it runs, the update is the same, so
    configs written for a GPU still train here) are said."""
    resolve_kernels(cfg.train.kernels, device)  # train.kernels=triton where Triton cannot run: its fix, in one line
    if device.type != "cpu":
        return []
    if cfg.parallel.cpu_offload:
        raise KilnError("parallel.cpu_offload keeps FSDP2's parameters, gradients and optimizer state in host "
                        "memory, and train.device is the CPU, whose memory that is: nothing would move; drop "
                        "--parallel.cpu_offload (parallel.strategy=fsdp still shards them over the ranks)",
                        key="parallel.cpu_offload", value=True, fix="drop --parallel.cpu_offload")
    notes = []
    blocks = cfg.memory.offload_blocks
    if blocks.strip().lower() not in ("", "none"):
        notes.append(f"memory.offload_blocks={blocks} does nothing on a CPU: it copies a GPU's saved activations "
                     f"to host memory, where a CPU run keeps them already (drop it to train the same without this "
                     f"line)")
    if cfg.optim.offload != "none":
        # measured: AdamW over fp32 parameters holds 8 bytes a parameter in state, 16 with optim.offload=host
        late = "; host-async also applies each update one step late" if cfg.optim.offload == "host-async" else ""
        notes.append(f"optim.offload={cfg.optim.offload} saves no memory on a CPU: the optimizer state it moves to "
                     f"the host is in host memory already, and it keeps fp32 copies of the parameters and gradients "
                     f"beside them (8 bytes a parameter more when the parameters are fp32){late}; "
                     f"--optim.offload=none uses less memory")
    return notes


def refuse_before_data(cfg: Config) -> None:
    """Settings the preset's shape refuses, found before the data is read and before the launch's process group:
    lora.targets against the family's linears, parallel.cp against data.seq_len and a mixture of experts (a
    model.init's shape is checked again once it is read: kiln.run.lm's layout())."""
    if cfg.lora.on and not cfg.model.init:
        resolved = cfg.model.resolve()
        resolve_targets(family(resolved.arch), resolved, cfg.lora.targets)
    if cfg.parallel.cp > 1:
        check_context_parallel(cfg.parallel, cfg.data.seq_len, moe=cfg.model.resolve().n_experts > 0)
