"""A LoRA training step measured on CPU, for tests/memory/test_lora.py and benchmarks/lora_memory.py: the base
built as kiln builds it, stored in bf16 under a mode that multiplies in half precision (bf16, bf16-master), LoRA
applied (kiln.models.lora.apply_lora: fp32 adapters, the rest frozen), kiln's optimizer over the adapters (fp32
masters under bf16-master), kiln's train_step under the mode's autocast; live tensor bytes counted per step as
kiln.run.measure.measure_step counts them."""
from __future__ import annotations

import time

import torch

from kiln.memory.measure import LiveBytes, tensor_bytes
from kiln.memory.levers import resolved_model
from kiln.models import build_model
from kiln.models.lora import apply_lora
from kiln.train.objective import LanguageModeling
from kiln.train.optim import build_optimizer
from kiln.train.precision import LossScaler, MasterWeights, Precision
from kiln.train.step import train_step


def lora_steps(cfg, steps: int = 2) -> tuple[list[int], list[float]]:
    """(peak live bytes, seconds) of each of `steps` LoRA steps of cfg (its lora section; rank 0: a full fine-tune)
    on random tokens, parameters and buffers included."""
    device = torch.device("cpu")
    model_cfg = resolved_model(cfg)
    model = build_model(model_cfg)
    mode = Precision(cfg.precision.mode, device)
    if cfg.lora.rank:
        if mode.row.compute_bytes == 2:
            model.to(torch.bfloat16)  # the frozen base in bf16: no autocast copy, no master
        apply_lora(model, cfg.lora, model_cfg)  # adapters in fp32 beside a bf16 base
        if mode.param_dtype != torch.float32:
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(mode.param_dtype)
    else:
        model.to(mode.param_dtype)
    masters = MasterWeights(model) if mode.row.masters else None
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": 0.0}]
    optimizer = build_optimizer(masters.groups(groups) if masters else groups, cfg.optim)
    scaler = LossScaler(cfg.precision, device, enabled=mode.loss_scaling)
    B, T, V = cfg.train.micro_batch_size, cfg.data.seq_len, model_cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    baseline = tensor_bytes(list(model.parameters()) + list(model.buffers())) \
        + (tensor_bytes(masters.masters) if masters else 0)
    tracker = LiveBytes(device, baseline=baseline)
    peaks, seconds = [], []
    for _ in range(steps):
        batches = []
        for _ in range(cfg.train.grad_accum_steps):
            x = torch.randint(0, V, (B, T + 1), generator=gen)
            batches.append((x[:, :-1], x[:, 1:]))
        tracker.peak = tracker.current()
        t0 = time.perf_counter()
        with tracker:
            train_step(model, batches, LanguageModeling(), optimizer, mode, scaler, cfg.optim, masters)
        seconds.append(time.perf_counter() - t0)
        peaks.append(tracker.peak)
    return peaks, seconds
