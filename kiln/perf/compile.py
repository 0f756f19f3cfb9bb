"""train.compile=auto: torch.compile where it pays for itself, judged from its measured cost and gain.

    compile_setting(value)                 "auto" | "true" | "false" from a config value (TOML booleans included)
    decide_compile(value, device, key, steps=, time_budget=)   (on, why): the resolved value and the one-line reason
    record_compile(key, compile_s, eager_step_s, compiled_step_s, device)   store a measurement (per machine)
    compile_key(model_cfg, precision, rows)   what a measurement depends on besides the machine

torch.compile costs its compile time once (inductor's C++/OpenMP code on a CPU, Triton on CUDA) and then saves
(eager − compiled) seconds a step, or loses them: it pays when a run is long enough. Both numbers are properties of
the machine, the torch build, the precision and the model's shape, so they are measured once
(benchmarks/compile_gain.py measures and records them) and kept with the other measurements of this machine
(kiln.perf.measured). `auto` with no measurement stays eager and says how to measure: compiling a first time just
to find out would cost the run the compile time it is trying to avoid.

A run of n steps pays when compile_s + n·compiled < n·eager. A run sized by train.time_budget (n = budget / eager)
compiles only when the compile time is also at most BUDGET_SHARE of the budget: its steps are sized from step 3
on, after the compile, so the compile time is on top of the budget, and the default job (120 s) must stay
under 3 minutes whole.
"""
from __future__ import annotations

import os
import shutil

import torch

from kiln.errors import KilnError
from kiln.perf.measured import lookup, store

SETTINGS = ("auto", "true", "false")
BUDGET_SHARE = 0.25  # a time-budgeted run spends at most this share of its budget compiling (120 s -> 30 s)


def compile_setting(value) -> str:
    """'auto', 'true' or 'false' from a train.compile value: a TOML/Python boolean or one of the three words."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in SETTINGS:
        return value.lower()
    raise KilnError(f"train.compile={value!r}; use auto, true or false", key="train.compile", value=value,
                    fix="use auto, true or false")


def compile_key(model_cfg, precision: str, rows: int) -> str:
    c = model_cfg
    return (f"{precision} {c.arch} layers {c.n_layer} d_model {c.d_model} heads {c.n_head} vocab {c.padded_vocab} "
            f"rows {rows}")


def cpu_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would call (its $CXX, else g++/clang++/c++ on the PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def record_compile(key: str, compile_s: float, eager_step_s: float, compiled_step_s: float,
                   device: torch.device | str = "cpu") -> None:
    store("compile", key, {"compile_s": compile_s, "eager_step_s": eager_step_s, "compiled_step_s": compiled_step_s},
          device)


def decide_compile(value, device: torch.device, key: str, steps: int = 0, time_budget: float = 0.0,
                   blocked_by: str | None = None) -> tuple[bool, str]:
    """(compile or not, why) for train.compile=`value` on `device`; `key` from compile_key; `steps` the run's
    optimizer steps (0: sized by `time_budget` seconds); `blocked_by` a setting that rules compile out."""
    setting = compile_setting(value)
    if setting != "auto":
        return setting == "true", f"train.compile={setting}"
    if blocked_by:
        return False, f"auto: off, {blocked_by}"
    if device.type == "cpu" and cpu_compiler() is None:
        return False, ("auto: off, no C++ compiler for inductor's CPU backend (install g++ or set $CXX; "
                       "train.compile=true would fail)")
    m = lookup("compile", key, device)
    if m is None:
        return False, ("auto: off, compile time and gain not measured for this shape and precision on this machine "
                       "(python benchmarks/compile_gain.py measures them)")
    cost, eager, compiled = m["compile_s"], m["eager_step_s"], m["compiled_step_s"]
    measured = f"compile {cost:.0f} s, step {eager:.3g} s eager vs {compiled:.3g} s compiled (measured)"
    if compiled >= eager:
        return False, f"auto: off, compiled steps are no faster: {measured}"
    n = steps or time_budget / eager
    saved = n * (eager - compiled)
    if not steps and cost > BUDGET_SHARE * time_budget:
        return False, (f"auto: off, compiling would take more than {BUDGET_SHARE:.0%} of train.time_budget="
                       f"{time_budget:g} s: {measured}")
    if saved <= cost:
        return False, f"auto: off, {n:,.0f} steps save {saved:.0f} s, less than the compile time: {measured}"
    return True, f"auto: on, {n:,.0f} steps save {saved:.0f} s, more than the compile time: {measured}"
