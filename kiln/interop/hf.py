"""Hugging Face checkpoints in and out, for every family that describes its mapping (kiln/models/<family>.py):
GPT2LMHeadModel, LlamaForCausalLM (with Llama 3's RoPE scaling), Qwen3ForCausalLM, Qwen3MoeForCausalLM.

    model_cfg, state = read_hf(DIR)           config.json + model.safetensors (or its shards) -> kiln's shape and
                                              state dict (kiln's names, vocabulary padded to kiln's multiple of 64)
    write_hf(model_cfg, state, vocab, OUT)    the reverse: config.json, model.safetensors (sharded above a size),
                                              generation_config.json, loadable by transformers' from_pretrained

It is a mapping, not a rename: kiln fuses q/k/v into attn.qkv and SwiGLU's gate and up into mlp.fc, GPT-2's
Conv1D stores its matrices as (in, out) where kiln's Linear stores (out, in), and kiln pads the vocabulary. Each
family lists its tensors as kiln.models.family.HFTensor records; this module applies them both ways. Only
safetensors and json are read and written: transformers is not needed, and nothing is ever downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError
from kiln.models import ModelConfig, family
from kiln.models.config import with_training_fields
from kiln.models.registry import by_hf_model_type

INDEX = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a Hugging Face model directory holds config.json and "
                                f"model.safetensors (save it with save_pretrained)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KilnError(f"{path} is not valid JSON ({e.msg})", key=str(path), value=f"line {e.lineno}",
                        fix="write it again (save_pretrained)") from None


def kiln_config(hf: dict, source: str = "config.json") -> ModelConfig:
    """kiln's ModelConfig for a Hugging Face config.json (every shape field set: no preset fills anything)."""
    return by_hf_model_type(hf.get("model_type"), source).hf_config_in(hf, source).resolve()


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    single, index = directory / "model.safetensors", directory / INDEX
    files = [single] if single.is_file() else None
    if files is None and index.is_file():
        files = [directory / name for name in sorted(set(_read_json(index)["weight_map"].values()))]
    if files is None:
        raise FileNotFoundError(f"{directory} holds neither model.safetensors nor {INDEX}; save the model with "
                                f"save_pretrained(..., safe_serialization=True)")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise KilnError(f"{f} does not load as safetensors ({e}); the file is damaged or truncated: copy it "
                            f"again", key=str(f), fix="the file is damaged or truncated: copy it again") from None
    return tensors


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _take(tensors: dict, name: str, shape: tuple, source: str) -> torch.Tensor:
    if name not in tensors and name.split(".", 1)[-1] in tensors:  # saved without the wrapper ("transformer.")
        name = name.split(".", 1)[-1]
    if name not in tensors:
        raise KilnError(f"{source}: no tensor {name!r}; the checkpoint does not match its config.json", key=source,
                        value=name, fix="save config.json and the weights together (save_pretrained)")
    t = tensors.pop(name)
    if tuple(t.shape) != tuple(shape):
        raise KilnError(f"{source}: {name} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}",
                        key=source, value=name, fix="save config.json and the weights together (save_pretrained)")
    return t


def read_hf(directory: str | Path, mine: ModelConfig | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """kiln's model config and state dict from a Hugging Face model directory. mine: the run's model section, whose
    training fields the config takes and whose recipe parts are checked against the checkpoint's
    (with_training_fields), before any tensor is read."""
    directory = Path(directory)
    hf = _read_json(directory / "config.json")
    cfg = kiln_config(hf, str(directory / "config.json"))
    if mine is not None:
        cfg = with_training_fields(cfg, mine)
    tensors = _read_tensors(directory)
    src = str(directory)
    fam = family(cfg.arch)
    shapes = dict(fam.parameter_shapes(cfg))
    out: dict[str, torch.Tensor] = {}
    for m in fam.hf_tensors(cfg):
        if m.kiln not in shapes:  # a bias kiln's config leaves out
            continue
        shape = shapes[m.kiln]
        rows = shape[0] if not m.vocab else cfg.vocab_size
        parts = []
        stacked = len(shape) == 3  # (E, out, in): every expert's weight, the parts along E·out rows
        for name, n in zip(m.hf, m.rows or (rows,)):
            part_shape = (n, *shape[2 if stacked else 1:])
            if m.conv1d:  # Conv1D: (in, out) -> Linear's (out, in)
                parts.append(_take(tensors, name, part_shape[::-1], src).t())
            else:
                parts.append(_take(tensors, name, part_shape, src))
        t = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        t = t.view(shape) if stacked else t
        out[m.kiln] = _pad_rows(t, cfg.padded_vocab) if m.vocab else t
    tensors.pop("lm_head.weight", None)  # a tied head saved anyway
    left = [k for k in tensors if not k.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))]
    if left:
        raise KilnError(f"{src}: tensors kiln has no place for: {', '.join(sorted(left)[:5])}"
                        + (" ..." if len(left) > 5 else ""), key=src, value=sorted(left)[0],
                        fix="start from a checkpoint of a family kiln builds, as save_pretrained wrote it")
    return cfg, out


def hf_config(cfg: ModelConfig, vocab: int, eos: int | None = None) -> dict:
    """The config.json of kiln's model for transformers (vocabulary without kiln's padding)."""
    refuse_unmapped_parts(cfg)
    return family(cfg.arch).hf_config_out(cfg, vocab, eos)


def refuse_unmapped_parts(cfg: ModelConfig) -> None:
    """A recipe part (model.mlp, model.qk_norm, model.logit_softcap) the family's Hub model has no form for."""
    refusal = family(cfg.arch).hf_refusal(cfg)
    if refusal:
        fix = "export without --hf (the kiln checkpoint), or train without that part"
        raise KilnError(f"kiln export --hf: {refusal}; {fix}", key="export.hf", fix=fix)


def _bias(state: dict, module: str) -> torch.Tensor:
    """A module's bias; zeros for kiln's bias-free GPT-2 (model.bias=false), which is GPT-2 with every bias 0."""
    if f"{module}.bias" in state:
        return state[f"{module}.bias"]
    weight = state[f"{module}.weight"]
    return weight.new_zeros(weight.shape[0])


def hf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """kiln's state dict under transformers' names and layouts, the vocabulary padding removed."""
    s = {k.removeprefix("_orig_mod."): v.detach().float().cpu() for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for m in family(cfg.arch).hf_tensors(cfg):
        t = s[m.kiln] if m.kiln in s or not m.zeros else _bias(s, m.kiln.removesuffix(".bias"))
        if m.vocab:
            t = t[:vocab]
        t = t.flatten(0, 1) if t.ndim == 3 else t  # stacked experts: (E·out, in), the parts along its rows
        parts = t.split(list(m.rows)) if m.rows else (t,)
        for name, part in zip(m.hf, parts):
            out[name] = part.t() if m.conv1d else part
    return {k: v.contiguous() for k, v in out.items()}


def write_hf(cfg: ModelConfig, state: dict[str, torch.Tensor], vocab: int, out_dir: str | Path,
             max_shard_bytes: int = 5 * 2**30, eos: int | None = None) -> list[Path]:
    """config.json, generation_config.json and model.safetensors (or shards and their index) in out_dir."""
    refuse_unmapped_parts(cfg)  # before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(cfg, state, vocab)
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, vocab, eos), indent=2) + "\n")
    generation = {"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    written = []
    if len(shards) == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return [out_dir / "model.safetensors"]
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        written.append(out_dir / file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return written
