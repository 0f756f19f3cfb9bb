"""A LoRA run's checkpoint read back as a base and its adapters: what `kiln sample`, `kiln eval` and `kiln export`
load (kiln.run.source, kiln.cli.export).

    lora = lora_run(cfg, weights, checkpoint)   the checkpoint's adapters under the Hub's module names, its base
    lora.merged()                                kiln's state dict, base + (alpha/rank)·B·A (sample, eval, --hf)
    lora.write_peft(OUT)                         adapter_config.json + adapter_model.safetensors (--peft)
    load_peft_adapters(model, model_cfg, lora)   lora.init=peft:DIR: the adapters of `model` set to DIR's
    merged_weights(model_cfg, lora, weights)     a LoRA model's state dict as the plain model's (the run's sample)

A run on model.init=hf:DIR saves the adapters only, with a reference to the base (kiln.interop.base): the base is
read from DIR again, after its files are checked against the digest the checkpoint recorded (a changed base is
refused in one line). A run on a base of its own (no model.init) saves the whole model, base included.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kiln.config import Config
from kiln.errors import KilnError
from kiln.interop.base import HF_PREFIX, check_base
from kiln.interop.hf import read_hf
from kiln.interop.peft import PEFT_PREFIX, PeftSpec, check_fits, hub_rows, merged, read_peft, write_peft
from kiln.models import ModelConfig
from kiln.models.lora import LoraConfig, lora_tensors


@dataclass
class LoraRun:
    model_cfg: ModelConfig
    lora: LoraConfig
    base: dict[str, torch.Tensor]  # the frozen base's weights, kiln's names
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Hub module -> (A (r, in), B (out, r))
    init: str  # model.init: the base as transformers loads it ("" for a base of the run's own)

    @property
    def scale(self) -> float:
        return self.lora.alpha / self.lora.rank

    def merged(self) -> dict[str, torch.Tensor]:
        return merged(self.model_cfg, self.base, self.adapters, self.scale)

    def write_peft(self, out: Path) -> Path:
        conv1d = {hub_rows(self.model_cfg)[m][3] for m in self.adapters}
        spec = PeftSpec(self.lora.rank, self.lora.alpha, self.lora.dropout, fan_in_fan_out=conv1d == {True},
                        base=self.init.removeprefix(HF_PREFIX))
        return write_peft(out, self.adapters, spec)


def to_hub(model_cfg: ModelConfig, lora: LoraConfig, weights: dict) -> tuple[dict, dict]:
    """(the adapters under the Hub's module names, the remaining weights) of a LoRA model's state dict."""
    names = {t.kiln: t for t in lora_tensors(model_cfg, lora)}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for key, t in weights.items():
        key = key.removeprefix("_orig_mod.")
        if key in names:
            pairs.setdefault(names[key].module, {})[names[key].matrix] = t.detach().float().cpu()
        else:
            rest[key] = t
    missing = sorted(set(names) - {k.removeprefix("_orig_mod.") for k in weights})
    if missing:
        raise KilnError(f"the checkpoint has no adapter {missing[0]} (and {len(missing) - 1} more) that its "
                        f"config's [lora] section builds; it was not written by this run's config",
                        key="lora", value=missing[0], fix="it was not written by this run's config")
    return {m: (ab["lora_A"], ab["lora_B"]) for m, ab in sorted(pairs.items())}, rest


def lora_run(cfg: Config, weights: dict, checkpoint: Path) -> LoraRun:
    """The base and adapters of a LoRA run's checkpoint (`weights`: its model weights, as Checkpointer.load_weights
    returns them). Raises BaseChanged when the base it refers to is not on disk as it was."""
    model_cfg = cfg.model.resolve()
    adapters, rest = to_hub(model_cfg, cfg.lora, weights)
    saved = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=True)
    ref = saved.get("base")
    if ref is None:  # the whole model was saved: the base is the rest of it
        base = dict(rest)
    else:
        check_base(ref, str(checkpoint))
        _, base = read_hf(ref["init"].removeprefix(HF_PREFIX))
    return LoraRun(model_cfg, cfg.lora, base, adapters, ref["init"] if ref is not None else "")


def merged_weights(model_cfg: ModelConfig, lora: LoraConfig, weights: dict) -> dict:
    """A LoRA model's whole state dict (base and adapters) as the plain model's: base + (alpha/rank)·B·A."""
    adapters, base = to_hub(model_cfg, lora, weights)
    return merged(model_cfg, base, adapters, lora.alpha / lora.rank)


@torch.no_grad()
def load_peft_adapters(model: torch.nn.Module, model_cfg: ModelConfig, lora: LoraConfig) -> None:
    """lora.init=peft:DIR: the adapters apply_lora gave `model` take DIR's values, after the directory is checked
    against the run's [lora] section (rank, alpha, the modules lora.targets adapts, their shapes): PeftError, one
    line, saying what differs. Nothing without lora.init."""
    if not lora.init:
        return
    directory = Path(lora.init.removeprefix(PEFT_PREFIX))
    adapters, spec = read_peft(directory)
    tensors = lora_tensors(model_cfg, lora)
    shapes = {t.module: [0, 0] for t in tensors}
    for t in tensors:
        shapes[t.module][0 if t.matrix == "lora_A" else 1] = t.shape[1] if t.matrix == "lora_A" else t.shape[0]
    check_fits(adapters, spec, f"{PEFT_PREFIX}{directory}", lora.rank, lora.alpha, lora.targets,
               {m: (n_in, n_out) for m, (n_in, n_out) in shapes.items()}, _targets_of(model_cfg, lora, adapters))
    for t in tensors:
        param = model.get_parameter(t.kiln)
        param.copy_(adapters[t.module][0 if t.matrix == "lora_A" else 1].to(param.dtype))


def _targets_of(model_cfg: ModelConfig, lora: LoraConfig, adapters: dict) -> str:
    """The lora.targets (the family's linear names) whose adapters include every module of `adapters`."""
    try:
        every = lora_tensors(model_cfg, replace(lora, targets="all"))
    except KilnError:  # a family whose `all` is refused (MoE experts): no hint
        return ""
    names = [t.base.split(".", 2)[2].removesuffix(".weight") for t in every if t.module in adapters]
    return ",".join(dict.fromkeys(names))
