"""Every model family kiln builds, by `model.arch`, and every preset: a plain dict, checked by the tests (each
family builds, runs, round-trips through Hugging Face's layout and is estimated byte for byte).

To add a family: write kiln/models/<family>.py (docs/models.md, "adding a family") and list it here.
"""
from __future__ import annotations

from kiln.models import gpt2, llama, qwen3, qwen3_moe
from kiln.models.config import ModelConfig
from kiln.models.family import Family
from kiln.util import closest
from kiln.errors import KilnError

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt2.FAMILY, llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY)}
ARCHS = tuple(FAMILIES)

PRESETS: dict[str, ModelConfig] = {}
for _family in FAMILIES.values():
    for _name, _cfg in _family.presets.items():
        _cfg.preset = _name
        PRESETS[_name] = _cfg


def family(arch: str) -> Family:
    """The description of the family `arch` (a ModelConfig's model.arch)."""
    if arch not in FAMILIES:
        hint = closest(arch, FAMILIES)
        raise KilnError(f"model.arch={arch!r} is unknown" + (f"; did you mean {hint!r}?" if hint else "")
                        + f" Use one of {', '.join(ARCHS)}",
                        key="model.arch", value=arch, fix=f"Use one of {', '.join(ARCHS)}")
    return FAMILIES[arch]


def by_hf_model_type(model_type: str | None, source: str) -> Family:
    for f in FAMILIES.values():
        if f.hf_model_type and f.hf_model_type == model_type:
            return f
    known = ", ".join(repr(f.hf_model_type) for f in FAMILIES.values() if f.hf_model_type)
    raise ValueError(f"{source}: model_type={model_type!r} is not one kiln reads; it reads {known}")
