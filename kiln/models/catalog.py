"""The tables a family and a preset are looked up in: FAMILIES (model.arch -> its description) and PRESETS
(model.preset -> ModelConfig), filled once by kiln.models.registry, which imports every family file, when
kiln.models is imported.

They live apart from the registry so that kiln.models.config, which the family files import to write their
presets, looks a family up without importing the family files back (no import cycle, tests/test_layering.py).
"""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.util import closest

FAMILIES: dict = {}  # model.arch -> kiln.models.family.Family
PRESETS: dict = {}  # model.preset -> kiln.models.config.ModelConfig


def add(fam) -> None:
    """List a family (kiln.models.family.Family) and its presets, each preset named by its key."""
    FAMILIES[fam.name] = fam
    for name, cfg in fam.presets.items():
        cfg.preset = name
        PRESETS[name] = cfg


def family(arch: str):
    """The description (kiln.models.family.Family) of the family `arch` (a ModelConfig's model.arch)."""
    if arch not in FAMILIES:
        hint = closest(arch, FAMILIES)
        raise KilnError(f"model.arch={arch!r} is unknown" + (f"; did you mean {hint!r}?" if hint else "")
                        + f" Use one of {', '.join(FAMILIES)}",
                        key="model.arch", value=arch, fix=f"Use one of {', '.join(FAMILIES)}")
    return FAMILIES[arch]
