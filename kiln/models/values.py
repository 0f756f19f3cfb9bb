"""The values a resolved model config must hold to train, and the overrides a preset would silently replace.

    check_values(cfg)                       after the preset is filled in: values no family can train with
    refuse_replaced(cfg, given, presets)    an explicit `--model.key=<sentinel>` that the preset would override

Both raise a KilnError naming the key, the value and the fix (kiln.config turns it into a ConfigError).
"""
from __future__ import annotations

import math

from kiln.errors import KilnError
from kiln.models.catalog import family

# What 0 / "" / None stands for in the model section: the preset's value (and for these keys, something more).
SENTINEL_MEANING = {
    "vocab_size": "the tokenizer's vocabulary when the preset has none",
    "d_ff": "derived from d_model when the preset has none",
    "n_kv_head": "n_head",
}


def check_values(cfg) -> None:
    """A resolved model config (every preset value filled in) whose numbers cannot train: one line, the fix."""
    if family(cfg.arch).positions == "rope" and not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise KilnError(f"model.rope_theta={cfg.rope_theta:g}: arch={cfg.arch!r} rotates queries and keys by RoPE, "
                        f"whose base frequency must be > 0; set --model.rope_theta=10000 (Llama 2) or "
                        f"500000 (Llama 3)",
                        key="model.rope_theta", value=cfg.rope_theta,
                        fix="set --model.rope_theta=10000 (Llama 2) or 500000 (Llama 3)")
    if not cfg.norm_eps > 0:
        raise KilnError(f"model.norm_eps={cfg.norm_eps:g}: normalization divides by sqrt(variance + eps), which "
                        f"is 0 on a constant input; set --model.norm_eps=1e-5 (GPT-2) or 1e-6 (Llama)",
                        key="model.norm_eps", value=cfg.norm_eps,
                        fix="set --model.norm_eps=1e-5 (GPT-2) or 1e-6 (Llama)")
    if cfg.vocab_size < 0:
        raise KilnError(f"model.vocab_size={cfg.vocab_size} is negative; give a size ≥ 1, or 0 for the "
                        f"tokenizer's",
                        key="model.vocab_size", value=cfg.vocab_size, fix="give a size ≥ 1, or 0 for the tokenizer's")


def _unset(value) -> bool:
    return value is None or (not isinstance(value, bool) and value in (0, ""))


def refuse_replaced(cfg, given: dict[str, object], presets: dict) -> None:
    """`given` ({key: value} of the model section, set explicitly on the command line): an explicit value equal
    to the "use the preset" sentinel (0, "", none) where the preset has a value of its own would be silently
    replaced by it. Refuse it, naming the preset's value; where the preset has none, the sentinel's own meaning
    (e.g. vocab_size=0: the tokenizer's) applies and the value is used."""
    base = presets.get(cfg.preset)
    if base is None:
        return  # an unknown preset is resolve()'s error, with the nearest name
    for key, value in given.items():
        if key in ("preset", "dropout") or not _unset(value):
            continue  # dropout 0.0 is a value (and every preset's)
        theirs = getattr(base, key, None)
        if _unset(theirs):
            continue  # the preset has none: 0 keeps its own meaning
        meaning = f" or {SENTINEL_MEANING[key]}" if key in SENTINEL_MEANING else ""
        shown = "none" if value is None else repr(value) if isinstance(value, str) else value
        raise KilnError(f"--model.{key}={shown} would be ignored: in the model section it means \"the preset's "
                        f"value\"{meaning}, and preset {cfg.preset!r} has {key}={theirs!r}; give the value you "
                        f"want (e.g. --model.{key}={_example(key, theirs)}), or drop the override",
                        key=f"model.{key}", value=value, fix="drop the override")


def _example(key: str, theirs) -> str:
    if key == "vocab_size":
        return "256 for data.tokenizer=bytes"
    if isinstance(theirs, bool):
        return "true or false"
    return str(theirs)
