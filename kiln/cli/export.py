"""`kiln export RUN_DIR --hf OUT_DIR [--shard-size SIZE]`: a run's latest checkpoint as a Hugging Face model
directory that transformers' AutoModelForCausalLM.from_pretrained loads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.config import ConfigError, load_config
from kiln.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from kiln.interop.hf import write_hf
from kiln.memory.estimate import fmt_bytes, parse_bytes
from kiln.models.registry import FAMILIES
from kiln.train.checkpoint import CheckpointConfig, Checkpointer


def exporting_families() -> tuple[str, ...]:
    """The model.arch of every family that describes its Hugging Face config and tensors (kiln.models.registry):
    what write_hf can write, and what the help names."""
    return tuple(name for name, f in FAMILIES.items() if f.hf_config_out is not None and f.hf_names is not None)


def add_parser(sub) -> None:
    families = ", ".join(exporting_families())
    p = sub.add_parser("export", help=f"write a run's model as a Hugging Face directory ({families})",
                       description=f"Write RUN_DIR's latest checkpoint as a Hugging Face model directory that "
                                   f"transformers' AutoModelForCausalLM.from_pretrained loads. Families that "
                                   f"export (model.arch): {families}.")
    p.add_argument("run_dir", help="a run directory written by `kiln train`")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="the directory to write (created)")
    p.add_argument("--shard-size", default="5GB", help="largest model-*.safetensors file (default 5GB)")


def run(args, overrides) -> int:
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    run_dir, out = Path(args.run_dir), Path(args.hf)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} has no config.toml; pass a run directory written by `kiln train`")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose a new directory (nothing is overwritten)")
    cfg = load_config(run_dir / "config.toml")
    weights = Checkpointer(CheckpointConfig(), run_dir).load_weights()
    tokenizer = load_tokenizer(run_dir)
    model_cfg = cfg.model.resolve()
    files = write_hf(model_cfg, weights, tokenizer.vocab_size, out, parse_bytes(args.shard_size),
                     eos=tokenizer.eot_id)
    if tokenizer.kind == "bpe":  # the `tokenizers` file transformers' fast tokenizer reads as it is
        shutil.copy(run_dir / TOKENIZER_FILE, out / TOKENIZER_FILE)
        eos = tokenizer.decode([tokenizer.eot_id])
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                               "eos_token": eos, "bos_token": eos}, indent=2))
        note = "tokenizer.json"
    else:
        note = "no tokenizer: kiln's byte tokenizer has no Hugging Face file (ids are the UTF-8 bytes, 0-255)"
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {out}: {model_cfg.arch} {len(files)} safetensors file(s), {fmt_bytes(size)}, config.json, "
          f"generation_config.json; {note}")
    return 0
