"""Every model family kiln builds, listed once: importing this module fills kiln.models.catalog (FAMILIES by
`model.arch`, PRESETS), checked by the tests (each
family builds, runs, round-trips through Hugging Face's layout and is estimated byte for byte).

To add a family: write kiln/models/<family>.py (docs/models.md, "adding a family") and list it here.
"""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.models import catalog, gpt2, llama, qwen3, qwen3_moe
from kiln.models.catalog import FAMILIES, PRESETS, family  # noqa: F401  (the lookups, re-exported)
from kiln.models.family import Family

for _family in (gpt2.FAMILY, llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY):
    catalog.add(_family)
ARCHS = tuple(FAMILIES)


def by_hf_model_type(model_type: str | None, source: str) -> Family:
    for f in FAMILIES.values():
        if f.hf_model_type and f.hf_model_type == model_type:
            return f
    known = ", ".join(repr(f.hf_model_type) for f in FAMILIES.values() if f.hf_model_type)
    raise KilnError(f"{source}: model_type={model_type!r} is not one kiln reads; it reads {known}",
                    key="model_type", value=model_type, fix=f"it reads {known}")
