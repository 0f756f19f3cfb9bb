"""PEFT's LoRA format in and out, and LoRA adapters merged into a base model's weights.

    write_peft(OUT, adapters, spec)      adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained
                                          writes them, under the Hub's module names
    adapters, spec = read_peft(DIR)      the reverse, checked (one line per problem: PeftError)
    merged(cfg, base, adapters, scale)   kiln's state dict with scale·B·A added to each adapted weight

`adapters` is PEFT's own form: {Hub module name: (A, B)}, A (r, in) and B (out, r) as PEFT stores them
(`base_model.model.<module>.lora_A.weight`), the same shapes for GPT-2's Conv1D, whose (in, out) weight PEFT
updates by the transposed product (`fan_in_fan_out`). kiln fuses q/k/v and gate/up into one matrix each; the
family's Hugging Face mapping (Family.hf_tensors) says which rows of which kiln tensor a Hub module is, so the
merge needs nothing else. Only json and safetensors are read and written: peft is not needed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError
from kiln.models import ModelConfig, family

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the transformers model: its keys start here
PEFT_PREFIX = "peft:"


class PeftError(KilnError):
    """A PEFT adapter directory kiln cannot use, or one that does not fit the run's [lora] section."""


@dataclass(frozen=True)
class PeftSpec:
    """What adapter_config.json says that kiln reads or writes."""

    rank: int
    alpha: float
    dropout: float = 0.0
    fan_in_fan_out: bool = False  # GPT-2's Conv1D
    targets: tuple[str, ...] = ()  # target_modules: module names or suffixes, as PEFT matches them
    base: str = ""  # base_model_name_or_path

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def module_suffixes(modules) -> list[str]:
    """target_modules for a set of Hub modules: each one's name after its layer number ("self_attn.q_proj",
    "mlp.c_fc"), which PEFT matches as a suffix; "c_proj" alone would also catch GPT-2's other c_proj."""
    out = set()
    for name in modules:
        parts = name.split(".")
        cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 0)
        out.add(".".join(parts[cut:]))
    return sorted(out)


def write_peft(out_dir: str | Path, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], spec: PeftSpec) -> Path:
    """adapter_config.json and adapter_model.safetensors in out_dir (created); returns the weights file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "fan_in_fan_out": spec.fan_in_fan_out,
              "target_modules": list(spec.targets or module_suffixes(adapters)), "bias": "none",
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "base_model_name_or_path": spec.base or None}
    tensors = {}
    for module, (a, b) in sorted(adapters.items()):
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.detach().float().cpu().contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.detach().float().cpu().contiguous()
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir / WEIGHTS


def read_peft(directory: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], PeftSpec]:
    """The adapters and the config of a PEFT LoRA directory (what save_pretrained wrote, or `kiln export --peft`)."""
    directory = Path(directory)
    where = f"{PEFT_PREFIX}{directory}"
    fix = "pass a directory PeftModel.save_pretrained or `kiln export RUN_DIR --peft DIR` wrote"
    if not (directory / CONFIG).is_file():
        raise PeftError(f"{where}: no {CONFIG} there; {fix}", key="lora.init", value=str(directory), fix=fix)
    try:
        config = json.loads((directory / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise PeftError(f"{where}/{CONFIG} is not valid JSON ({e.msg}); {fix}", key="lora.init") from None
    kind = config.get("peft_type")
    if kind != "LORA":
        raise PeftError(f"{where}: peft_type={kind!r}; kiln reads LoRA adapters (peft_type LORA)", key="lora.init")
    for flag, what in (("use_dora", "DoRA"), ("use_rslora", "rsLoRA (scale alpha/√r)")):
        if config.get(flag):
            raise PeftError(f"{where}: {flag}=true; kiln's adapters are plain LoRA, not {what}", key="lora.init")
    if config.get("bias", "none") != "none" or config.get("modules_to_save") or config.get("rank_pattern") \
            or config.get("alpha_pattern"):
        raise PeftError(f"{where}: bias, modules_to_save, rank_pattern or alpha_pattern are set; kiln reads "
                        f"adapters of one rank and scale with no bias and no other trained modules", key="lora.init")
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise PeftError(f"{where}: no {WEIGHTS} there (a .bin adapter is not read: save it again with "
                        f"safe_serialization=True)", key="lora.init")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise PeftError(f"{where}/{WEIGHTS} does not load as safetensors ({e}); copy it again",
                        key="lora.init") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key.removeprefix(PREFIX)
        module, _, which = name.rpartition(".lora_")
        if which not in ("A.weight", "B.weight"):
            raise PeftError(f"{where}/{WEIGHTS} holds {key!r}, which is no lora_A/lora_B weight; kiln reads LoRA "
                            f"adapters only", key="lora.init")
        pairs.setdefault(module.removesuffix(".default"), {})[which[0]] = t.float()
    adapters = {}
    rank = int(config.get("r", 8))
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise PeftError(f"{where}/{WEIGHTS}: {module} has lora_{''.join(ab)} without its pair", key="lora.init")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise PeftError(f"{where}/{WEIGHTS}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                            f"not (r={rank}, in) and (out, r={rank})", key="lora.init")
        adapters[module] = (a, b)
    targets = config.get("target_modules") or ()
    spec = PeftSpec(rank=rank, alpha=float(config.get("lora_alpha", 8)), dropout=float(config.get("lora_dropout", 0)),
                    fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
                    targets=(targets,) if isinstance(targets, str) else tuple(targets),
                    base=config.get("base_model_name_or_path") or "")
    return adapters, spec


def hub_rows(cfg: ModelConfig) -> dict[str, tuple[str, int, int, bool]]:
    """{Hub module: (kiln weight, first row, rows, conv1d)} for every 2-D weight of the family's mapping."""
    out = {}
    for m in family(cfg.arch).hf_tensors(cfg):
        if not m.kiln.endswith(".weight") or m.vocab:
            continue
        start = 0
        for name, rows in zip(m.hf, m.rows or (None,)):
            out[name.removesuffix(".weight")] = (m.kiln, start, rows, m.conv1d)
            start += rows or 0
    return out


def merged(cfg: ModelConfig, base: dict[str, torch.Tensor], adapters: dict, scale: float) -> dict[str, torch.Tensor]:
    """kiln's state dict `base` with scale·B·A added to the rows each Hub module holds (new tensors, fp32 sums; the
    result keeps each weight's dtype). A module the family does not have is an error naming it."""
    rows_of = hub_rows(cfg)
    out = dict(base)
    for module, (a, b) in adapters.items():
        if module not in rows_of:
            raise PeftError(f"adapter for {module!r}, which is not a weight of kiln's {cfg.arch} model; the adapter "
                            f"was trained on another base", key="lora.init")
        name, start, rows, _ = rows_of[module]
        weight = out[name]
        rows = rows or weight.shape[0]
        delta = scale * (b.double() @ a.double())  # (out, in) for Linear and Conv1D alike: kiln stores (out, in)
        if tuple(delta.shape) != (rows, weight.shape[1]):
            raise PeftError(f"adapter for {module} makes a {tuple(delta.shape)} update, the base weight is "
                            f"{(rows, weight.shape[1])}; the adapter was trained on another base", key="lora.init")
        new = weight.detach().clone()
        new[start:start + rows] = (weight[start:start + rows].double() + delta.to(weight.device)).to(weight.dtype)
        out[name] = new
    return out



def check_fits(adapters: dict, spec: PeftSpec, where: str, rank: int, alpha: float, targets: str,
               expected: dict[str, tuple[int, int]], hint: str = "") -> None:
    """That a read adapter is the one the run's [lora] section builds: its rank and alpha, its modules
    (`expected`: {Hub module: (in, out)}) and their shapes; else one line saying what differs and what to pass
    (hint: the lora.targets that cover the adapter's modules, when the caller knows them)."""
    def refuse(why: str, fix: str):
        raise PeftError(f"{where}: {why}; {fix}", key="lora.init", value=where, fix=fix)

    if spec.rank != rank:
        refuse(f"the adapter has rank r={spec.rank}, the run lora.rank={rank}", f"pass --lora.rank={spec.rank}")
    if spec.alpha != alpha:
        refuse(f"the adapter has lora_alpha={spec.alpha:g}, the run lora.alpha={alpha:g}",
               f"pass --lora.alpha={spec.alpha:g}")
    missing = sorted(set(expected) - set(adapters))
    extra = sorted(set(adapters) - set(expected))
    if missing or extra:
        said = [f"{len(missing)} module(s) lora.targets={targets!r} adapts have none (first {missing[0]})"] \
            if missing else []
        said += [f"{len(extra)} adapted module(s) lora.targets={targets!r} leaves out (first {extra[0]})"] if extra else []
        fix = f"pass --lora.targets={hint}" if hint and hint != targets else "pass the lora.targets it was trained with"
        refuse(" and ".join(said), f"{fix} (its modules: {', '.join(module_suffixes(adapters))})")
    for module, (n_in, n_out) in expected.items():
        a, b = adapters[module]
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            refuse(f"{module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, this base needs "
                   f"{(rank, n_in)} and {(n_out, rank)}", "the adapter was trained on another base: use that base "
                                                          "(model.init=hf:DIR)")
