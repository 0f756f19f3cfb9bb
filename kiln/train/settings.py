"""The `train` section (TrainConfig: steps, batch, evaluation, device, compile, kernels, time limits) and the
duration syntax train.max_time takes. Kept apart from the loop so that the parts the loop composes (kiln.train.budget,
kiln.train.gap) take their section without importing the loop back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.perf.allocator import allocator_setting
from kiln.perf.compile import compile_setting
from kiln.perf.cpu_linear import cpu_linear_setting

KERNELS = ("torch", "triton", "auto")


@dataclass
class TrainConfig:
    max_steps: int = 0  # optimizer steps (each micro_batch_size·grad_accum_steps sequences); 0: fit time_budget
    time_budget: float = 120.0  # max_steps=0: seconds of training steps, sized by the time of steps 3-10 (to 30)
    micro_batch_size: int = 8  # sequences per forward/backward pass
    grad_accum_steps: int = 1  # micro-batches accumulated into one optimizer step (per rank)
    global_batch_size: int = 0  # sequences per optimizer step over all ranks; sets grad_accum_steps (0: off)
    eval_interval: int = 0  # steps between validation passes (0: only at the end)
    eval_batches: int = 20  # validation micro-batches per evaluation (0: every (len(val)-1)//seq_len window of the val split, in order)
    eval_micro_batch_size: int = 0  # windows per evaluation forward: the same windows, in the same order, only grouped (0: auto: micro_batch_size, on a CPU grown to up to 8,192 tokens and 64 MiB of logits per forward; the tiny preset's full split at seq 256, one thread, 2-core AMX Xeon: 32 windows, bf16 0.87x the CPU time of 8, fp32 0.99x)
    stop_at_val_loss: float = 0.0  # stop at the first evaluation (every train.eval_interval) whose val loss is at or below this (0: off)
    eval_tasks: tuple[str, ...] = ()  # task files scored at every evaluation, as `kiln eval --task` takes them (multiple-choice .jsonl, text:FILE); logged as task_<stem>_acc, _acc_norm, _acc_stderr or _bpb
    eval_task_limit: int = 0  # items per task per evaluation, the file's first ones (0: all)
    early_stop_patience: int = 0  # stop after this many evaluations without a better val loss (0: never)
    early_stop_min_delta: float = 0.0  # a val loss must beat the best by more than this to count as better
    gap_patience: int = 3  # warn once when val − train loss grew this many evals in a row as train fell (0: off)
    deterministic: bool = False  # deterministic kernels (use_deterministic_algorithms; CUDA: cuBLAS, math SDPA)
    seed: int = 1337  # seed of model init and every training RNG stream
    device: str = "auto"  # "auto" (cuda when available, else cpu) | "cpu" | "cuda" | "cuda:N"
    compile: bool | str = "auto"  # torch.compile: true | false | auto (on when its measured compile time and gain pay off over the run; kiln.perf.compile)
    compile_decided_by: str = ""  # written by kiln train: why train.compile resolved as it did (auto's prediction, or the config)
    kernels: str = "torch"  # "torch" | "triton" | "auto" (Triton on CUDA compute capability ≥ 8.0 when importable)
    cpu_linear: str = "auto"  # fp32 linears on a CPU: auto (oneDNN where it is measured ≥ 1.1x torch's MKL product, 2.25x on an AMD Zen 5) | onednn | torch
    cpu_linear_decided_by: str = ""  # written by kiln train: why train.cpu_linear resolved as it did (auto's measurement, or the config)
    cpu_allocator: str = "auto"  # glibc malloc on a CPU: auto (tuned on a CPU device with glibc, else system) | tuned (keeps freed step buffers: mmap threshold 32 MiB, trim 1 GiB; on a 2-core AMX Xeon kiln-bf16 0.86x -> 0.99x the plain bf16 loop, page faults 0.4-1.5 M -> 0.18 M, max RSS 843 -> 957 MiB) | system
    cpu_allocator_decided_by: str = ""  # written by kiln train and kiln.fit: why train.cpu_allocator resolved as it did (MALLOC_*_THRESHOLD_ or an LD_PRELOADed allocator leave it to the user)
    max_time: str = ""  # wall-clock limit, e.g. 3h50m or 90s: the run saves and ends at the step that crosses it
    sample_tokens: int = 200  # tokens generated after training (0: no sample)
    sample_prompt: str = "def "  # prompt of the sample printed after training

    def validate(self):
        for key in ("micro_batch_size", "grad_accum_steps"):
            if getattr(self, key) < 1:
                raise KilnError(f"train.{key} must be ≥ 1, got {getattr(self, key)}",
                                key=f"train.{key}", value=getattr(self, key), fix="give a value ≥ 1")
        for key in ("max_steps", "time_budget", "eval_interval", "early_stop_patience", "sample_tokens",
                    "early_stop_min_delta", "global_batch_size", "gap_patience", "eval_task_limit", "eval_batches",
                    "eval_micro_batch_size", "stop_at_val_loss"):
            if getattr(self, key) < 0:
                raise KilnError(f"train.{key} must be ≥ 0, got {getattr(self, key)}",
                                key=f"train.{key}", value=getattr(self, key), fix="give a value ≥ 0")
        if self.max_steps == 0 and self.time_budget == 0:
            raise KilnError("train.max_steps=0 sizes the run by train.time_budget, which is 0 too; set "
                            "--train.max_steps=N or --train.time_budget=SECONDS",
                            key="train.max_steps", value=0,
                            fix="set --train.max_steps=N or --train.time_budget=SECONDS")
        if self.stop_at_val_loss and not self.eval_interval:
            raise KilnError(f"train.stop_at_val_loss={self.stop_at_val_loss:g} is checked at each evaluation, and "
                            f"train.eval_interval=0 evaluates only at the end: set --train.eval_interval=N",
                            key="train.stop_at_val_loss", value=self.stop_at_val_loss,
                            fix="set --train.eval_interval=N")
        if self.device != "auto" and not self.device.split(":")[0] in ("cpu", "cuda", "mps"):
            raise KilnError(f"train.device={self.device!r}; use auto, cpu, cuda or cuda:N",
                            key="train.device", value=self.device, fix="use auto, cpu, cuda or cuda:N")
        if self.global_batch_size % self.micro_batch_size:
            raise KilnError(f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                            f"train.micro_batch_size={self.micro_batch_size}",
                            key="train.global_batch_size", value=self.global_batch_size,
                            fix=f"give a multiple of train.micro_batch_size={self.micro_batch_size}")
        parse_duration(self.max_time)
        if not all(isinstance(t, str) and t for t in self.eval_tasks):
            raise KilnError(f"train.eval_tasks={list(self.eval_tasks)!r} must list task files, e.g. "
                            f"--train.eval_tasks='[\"hellaswag.jsonl\", \"text:val.txt\"]'",
                            key="train.eval_tasks", value=list(self.eval_tasks), fix="list task files")
        compile_setting(self.compile)
        if self.kernels not in KERNELS:
            raise KilnError(f"train.kernels={self.kernels!r} is unknown; use one of {KERNELS}",
                            key="train.kernels", value=self.kernels, fix=f"use one of {KERNELS}")
        cpu_linear_setting(self.cpu_linear)
        allocator_setting(self.cpu_allocator)


def parse_duration(text: str) -> float | None:
    """'3h50m', '90s', '1.5h', '45m' -> seconds; '' -> None."""
    if not text:
        return None
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*", text)
    if not parts or not any(parts.groups()):
        raise KilnError(f"train.max_time={text!r}: write a duration such as 3h50m, 45m or 90s",
                        key="train.max_time", value=text, fix="write a duration such as 3h50m, 45m or 90s")
    h, m, sec = (float(g) if g else 0.0 for g in parts.groups())
    return 3600 * h + 60 * m + sec
