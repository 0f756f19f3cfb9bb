"""`kiln export RUN_DIR --hf OUT_DIR [--shard-size SIZE]`: a run's latest checkpoint as a Hugging Face model
directory that transformers' AutoModelForCausalLM.from_pretrained loads (a LoRA run's: the base with the adapters
merged in). `kiln export RUN_DIR --peft OUT_DIR`: a LoRA run's adapters as PEFT writes them, for
peft.PeftModel.from_pretrained on the base (kiln.interop.peft)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.config import ConfigError, load_config
from kiln.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from kiln.interop.hf import write_hf
from kiln.memory.estimate import fmt_bytes, parse_bytes
from kiln.models.registry import FAMILIES
from kiln.run.adapters import lora_run
from kiln.train.checkpoint import CheckpointConfig, Checkpointer


def exporting_families() -> tuple[str, ...]:
    """The model.arch of every family that describes its Hugging Face config and tensors (kiln.models.registry):
    what write_hf can write, and what the help names."""
    return tuple(name for name, f in FAMILIES.items() if f.hf_config_out is not None and f.hf_names is not None)


def add_parser(sub) -> None:
    families = ", ".join(exporting_families())
    p = sub.add_parser("export", help=f"write a run's model as a Hugging Face directory ({families}), or a LoRA "
                                      f"run's adapters as PEFT's",
                       description=f"Write RUN_DIR's latest checkpoint as a Hugging Face model directory that "
                                   f"transformers' AutoModelForCausalLM.from_pretrained loads (--hf; a LoRA run's "
                                   f"adapters merged into its base), or a LoRA run's adapters as a PEFT directory "
                                   f"(--peft). Families that export (model.arch): {families}.")
    p.add_argument("run_dir", help="a run directory written by `kiln train`")
    p.add_argument("--hf", metavar="OUT_DIR", help="write the whole model here (created); a LoRA run's with its "
                                                   "adapters merged into the base")
    p.add_argument("--peft", metavar="OUT_DIR", help="a LoRA run (lora.rank > 0): write its adapters here (created) as "
                                                     "adapter_config.json and adapter_model.safetensors, which "
                                                     "peft.PeftModel.from_pretrained loads onto the base")
    p.add_argument("--shard-size", default="5GB", help="largest model-*.safetensors file (default 5GB)")


def run(args, overrides) -> int:
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)}")
    if (args.hf is None) == (args.peft is None):
        raise ConfigError("kiln export takes exactly one of --hf OUT_DIR (the whole model) and --peft OUT_DIR (a LoRA "
                          "run's adapters); run it twice for both")
    run_dir, out = Path(args.run_dir), Path(args.hf or args.peft)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} has no config.toml; pass a run directory written by `kiln train`")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose a new directory (nothing is overwritten)")
    cfg = load_config(run_dir / "config.toml")
    if args.peft is not None and not cfg.lora.on:
        raise ConfigError(f"{run_dir} is not a LoRA run (lora.rank=0): it has no adapters; export the model with "
                          f"--hf OUT_DIR")
    if args.peft is not None and not cfg.model.init:
        raise ConfigError(f"{run_dir} trained LoRA adapters on a base of its own (no model.init=hf:DIR), which "
                          f"transformers cannot load; export the merged model with --hf OUT_DIR")
    checkpointer = Checkpointer(CheckpointConfig(), run_dir)
    weights = checkpointer.load_weights()
    # the checkpoint's own config: the run as it was at that step
    cfg = load_config(checkpointer.loaded / "config.toml") if (checkpointer.loaded / "config.toml").is_file() else cfg
    lora = lora_run(cfg, weights, checkpointer.loaded) if cfg.lora.on else None
    if args.peft is not None:
        path = lora.write_peft(out)
        print(f"wrote {out}: LoRA adapters for {len(lora.adapters)} modules (rank {cfg.lora.rank}, alpha "
              f"{cfg.lora.alpha:g}), {fmt_bytes(path.stat().st_size)}, adapter_config.json; base {cfg.model.init}")
        return 0
    if lora is not None:
        weights = lora.merged()
    tokenizer = load_tokenizer(run_dir)
    model_cfg = cfg.model.resolve()
    files = write_hf(model_cfg, weights, tokenizer.vocab_size, out, parse_bytes(args.shard_size, "--shard-size"),
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
    merged = f" (LoRA rank {cfg.lora.rank} merged into {cfg.model.init or 'its base'})" if lora is not None else ""
    print(f"wrote {out}: {model_cfg.arch}{merged} {len(files)} safetensors file(s), {fmt_bytes(size)}, config.json, "
          f"generation_config.json; {note}")
    return 0

