"""A trained model to evaluate or sample from, named the way a user names it on the command line:

    RUN_DIR                             the run's newest checkpoint that verifies
    RUN_DIR/checkpoints/step_NNNNNN     that checkpoint
    hf:DIR                              a Hugging Face model directory of any family kiln imports (kiln.interop.hf)

    source = load_source("runs/default")
    source.model, source.tokenizer, source.model_cfg, source.step, source.eot_id, source.eos_ids

`kiln eval` and `kiln sample` both load through here. Whatever is wrong with the name (no such checkpoint, a run
that saved none, an hf: directory without weights) is a SourceError naming the path, which the CLI prints as
one line (exit 2).

A LoRA run's checkpoint (lora.rank > 0) is its adapters and a reference to its base (kiln.run.adapters): the base
is read again (refused in one line when its files changed on disk) and the adapters merged into it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.data.chat import special_tokens
from kiln.data.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from kiln.errors import KilnError
from kiln.interop.hf import read_hf
from kiln.models import ModelConfig, Transformer, build_model, param_count
from kiln.run.adapters import lora_run
from kiln.run.lm import pick_device
from kiln.train.checkpoint import CheckpointConfig, Checkpointer

HF_PREFIX = "hf:"
STEP_DIR = re.compile(r"step_(\d+)")


class SourceError(KilnError):
    """A model source that cannot be loaded; the message names the path and what to pass instead."""

    def __init__(self, path, why: str):
        self.path = Path(path)
        super().__init__(why if why.startswith(str(path)) else f"{path}: {why}", key=str(path))


@dataclass
class ModelSource:
    model: Transformer  # eval mode, on `device`
    tokenizer: Tokenizer
    model_cfg: ModelConfig  # resolved: every shape field set
    step: int | None  # the checkpoint's step; None for hf:
    eot_id: int  # the id that ends a document (the tokenizer's)
    eos_ids: tuple[int, ...]  # ids that end generation: eot_id, and for hf: every eos_token_id the directory names
    description: str  # one line: what was loaded, from where
    device: torch.device
    # lm-evaluation-harness's prefix token (an empty context; the first rolling window): for hf: the bos_token of
    # tokenizer_config.json, else its eos_token, as transformers reads them; else (and for a run) eot_id
    prefix_id: int | None = None

    @property
    def max_seq_len(self) -> int:
        return self.model_cfg.max_seq_len


def load_source(spec: str | Path, device: str = "auto", dtype: torch.dtype = torch.float32) -> ModelSource:
    """The model `spec` names (RUN_DIR, RUN_DIR/checkpoints/step_NNNNNN or hf:DIR), in eval mode on `device`."""
    text = str(spec)
    dev = pick_device(device)
    if text.startswith(HF_PREFIX):
        return _from_hf(Path(text[len(HF_PREFIX):]), dev, dtype)
    return _from_run(Path(text), dev, dtype)


def _from_run(path: Path, dev: torch.device, dtype: torch.dtype) -> ModelSource:
    checkpoint = None
    if STEP_DIR.fullmatch(path.name) and path.parent.name == "checkpoints":  # one checkpoint of a run
        checkpoint, run_dir = path, path.parent.parent
    else:
        run_dir = path
    if not run_dir.is_dir():
        raise SourceError(run_dir, "does not exist; pass a run directory written by `kiln train`, one of its "
                                   "checkpoints (RUN_DIR/checkpoints/step_NNNNNN) or hf:DIR")
    if not (run_dir / "config.toml").is_file():
        raise SourceError(run_dir, "has no config.toml; pass a run directory written by `kiln train`, one of its "
                                   "checkpoints (RUN_DIR/checkpoints/step_NNNNNN) or hf:DIR")
    if checkpoint is not None and not checkpoint.is_dir():
        have = sorted(p.name for p in checkpoint.parent.glob("step_*") if p.is_dir())
        raise SourceError(checkpoint, f"no such checkpoint; the run has {', '.join(have) or 'none'} (`kiln "
                                      f"checkpoints {run_dir}` lists them)")
    weights, checkpoint = _run_weights(run_dir, checkpoint, dev)
    # the checkpoint's own config.toml: the model as it was at that step (a resume may have changed the run's)
    cfg = load_config(checkpoint / "config.toml" if (checkpoint / "config.toml").is_file() else run_dir / "config.toml")
    model_cfg = cfg.model.resolve()
    model = build_model(model_cfg, dev)
    step = int(STEP_DIR.fullmatch(checkpoint.name).group(1))
    what = f"{run_dir} step {step}"
    if cfg.lora.on:  # base + adapters, merged: the plain model generates with the KV cache as any other
        weights = lora_run(cfg, weights, checkpoint).merged()
        what += f" (LoRA rank {cfg.lora.rank} on {cfg.model.init or 'its own base'})"
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(not k.startswith("rope_") for k in missing):  # a base read from hf:DIR has no rope_
        raise SourceError(checkpoint, f"the checkpoint does not fill kiln's model (missing {missing[:3]}, "
                                      f"unexpected {unexpected[:3]})")
    model.to(dtype).eval()
    tokenizer = load_tokenizer(run_dir)
    return ModelSource(model, tokenizer, model_cfg, step, tokenizer.eot_id, (tokenizer.eot_id,),
                       _describe(what, model_cfg), dev)


def _run_weights(run_dir: Path, checkpoint: Path | None, dev: torch.device) -> tuple[dict, Path]:
    """The model weights of `checkpoint` (None: the newest that verifies) and the checkpoint they came from (a LoRA
    run's: its adapters, and its base unless it refers to model.init's)."""
    checkpointer = Checkpointer(CheckpointConfig(), run_dir)
    if checkpoint is None and checkpointer.latest() is None:
        raise SourceError(run_dir, str(checkpointer.none_error()))  # none saved yet, or none verifies
    weights = checkpointer.load_weights(map_location=dev, path=checkpoint)
    return weights, checkpointer.loaded


def _from_hf(directory: Path, dev: torch.device, dtype: torch.dtype) -> ModelSource:
    if not directory.is_dir():
        raise SourceError(directory, "does not exist; hf:DIR names a Hugging Face model directory (config.json and "
                                     "model.safetensors, as save_pretrained writes them)")
    try:
        model_cfg, weights = read_hf(directory)
    except FileNotFoundError as e:  # read_hf's message names the file and how to write it
        raise SourceError(directory, str(e)) from None
    model = build_model(model_cfg, dev)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(not k.startswith("rope_") for k in missing):  # rope_ tables are computed, not saved
        raise SourceError(directory, f"the checkpoint does not fill kiln's model (missing {missing[:3]}, "
                                     f"unexpected {unexpected[:3]})")
    model.to(dtype).eval()
    hf_config = json.loads((directory / "config.json").read_text())
    if (directory / TOKENIZER_FILE).is_file():
        tokenizer = BPETokenizer.from_hf(directory)
    elif hf_config.get("vocab_size") == ByteTokenizer.vocab_size:  # what `kiln export` writes for a bytes run
        tokenizer = ByteTokenizer()
    else:
        raise SourceError(directory, f"has no {TOKENIZER_FILE}; copy the model's tokenizer.json beside its "
                                     f"config.json")
    eos = [tokenizer.eot_id]
    generation = directory / "generation_config.json"
    for config in ([json.loads(generation.read_text())] if generation.is_file() else []) + [hf_config]:
        ids = config.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids] if ids is not None else []:
            if int(i) not in eos:
                eos.append(int(i))
    return ModelSource(model, tokenizer, model_cfg, None, tokenizer.eot_id, tuple(eos),
                       _describe(f"{HF_PREFIX}{directory}", model_cfg), dev, _prefix_id(directory, tokenizer))


def _prefix_id(directory: Path, tokenizer) -> int | None:
    """The id of the directory's bos_token, else of its eos_token (tokenizer_config.json, else
    special_tokens_map.json): the prefix token lm-evaluation-harness's HFLM takes. None when neither names one
    token of the tokenizer."""
    named = special_tokens(directory)
    for key in ("bos_token", "eos_token"):
        text = named.get(key)
        ids = tokenizer.encode_as_transformers(text, add_special_tokens=False) if text and \
            hasattr(tokenizer, "encode_as_transformers") else []
        if len(ids) == 1:
            return ids[0]
    return None


def _describe(what: str, cfg: ModelConfig) -> str:
    return (f"{what} ({cfg.arch}, {param_count(cfg) / 1e6:.2f}M parameters, {cfg.n_layer} layers, max_seq_len "
            f"{cfg.max_seq_len})")
