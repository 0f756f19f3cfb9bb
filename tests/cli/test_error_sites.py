"""Every place kiln raises a KilnError (or a subclass) reaches the user as one line, and each is accounted for.

kiln/errors.py's KilnError carries `key`, `value` and `fix`; the `kiln` command prints it once as
`kiln CMD: error: ...` and exits 2. Two checks:

- `test_every_raise_site_is_in_the_table`: the sources are parsed (ast, no imports) for `raise KilnError(...)` and
  `raise <subclass>(...)`; each site, named `path:qualname` of the function it is in, must be in SITES (one row
  per raise in that function) or in ALLOWED with a reason. A row or allowance for a site that no longer raises
  fails too, so the table cannot go stale.
- `test_site_is_one_line`: each row runs the real entry point in this process: exit status 2, one stderr line
  holding the fragments and naming the key, no traceback; then again with `--traceback`, which must raise, and the
  innermost KilnError of the chain must come from the row's site (the row really reaches that raise).
"""
from __future__ import annotations

import ast
import json
import math
import os
import struct
from pathlib import Path

import pytest

from kiln.cli.main import main
from kiln.errors import KilnError

ROOT = Path(__file__).resolve().parents[2]
KILN = ROOT / "kiln"
M = ["memory", "--out=", "--model.preset=tiny"]  # `kiln memory` validates the whole config and builds the layout
P2 = [*M, "--ranks=2", "--parallel.strategy=fsdp"]
T = ["train", "--model.preset=tiny", "--train.device=cpu", "--data.source=nowhere.txt"]  # refused before the data
TD = ["train", "--model.preset=tiny", "--train.device=cpu", "--data.source=tiny.txt", "--data.seq_len=32",
      "--train.micro_batch_size=1", "--train.max_steps=1"]  # the model is built (the error comes at it), no step runs
E = ["estimate", "--model.preset=tiny", "--device=H100"]
D = ["train", "--model.preset=tiny", "--train.device=cpu", "--data.source=short.txt", "--data.cache_dir=cache",
     "--data.workers=1"]  # prepares short.txt (under a second), refused before the model is built


def _safetensors(shapes: dict) -> bytes:
    """A safetensors file of fp32 zeros (8-byte header length, the JSON header, the data): a checkpoint whose
    tensors do not match its config.json, without building a model."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(offset)


def _hf_with_extra(directory: Path) -> None:
    """A whole checkpoint of GPT2 (as `kiln export --hf` writes it) plus one tensor kiln has no place for."""
    import torch
    from safetensors.torch import load_file, save_file

    from kiln.interop.hf import kiln_config, write_hf
    from kiln.models import family

    cfg = kiln_config(GPT2)
    write_hf(cfg, {n: torch.zeros(s) for n, s in family(cfg.arch).parameter_shapes(cfg)}, GPT2["vocab_size"],
             directory)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({**tensors, "extra.weight": torch.zeros(1)}, str(directory / "model.safetensors"))


# Hugging Face config.json files (the smallest each family's reader takes) for `kiln sample hf:DIR`, which reads
# config.json before any weight
GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 300, "n_positions": 32}
LLAMA = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
         "intermediate_size": 32, "vocab_size": 300, "max_position_embeddings": 32}
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 8}

# Files the rows name, written into the test's working directory: [[data.mix]] is a list of tables, which only a
# file can give; Hugging Face directories, run directories, a corpus. A callable writes its directory itself.
FILES = {
    "mix_and_source.toml": '[data]\nsource = "a.txt"\n[[data.mix]]\nsource = "b.txt"\n',
    "mix_not_table.toml": '[data]\nmix = [1]\n',
    "mix_unknown_key.toml": '[[data.mix]]\nsource = "a.txt"\nwieght = 2\n',
    "mix_no_source.toml": '[[data.mix]]\nweight = 2\n',
    "mix_zero_weight.toml": '[[data.mix]]\nsource = "a.txt"\nweight = 0\n',
    "mix_name_number.toml": '[[data.mix]]\nsource = "a.txt"\nname = 3\n',
    "mix_bpe_tokens.toml": '[data]\ntokenizer = "bpe"\n[[data.mix]]\nsource = "a.bin"\nformat = "tokens"\n',
    "mix_same_name.toml": '[[data.mix]]\nsource = "a.txt"\n[[data.mix]]\nsource = "x/a.txt"\n',
    "mix_records.toml": '[[data.mix]]\nsource = "a.jsonl"\nrecords = "chat"\n[[data.mix]]\nsource = "b.txt"\n',
    "bad.jinja": "{% for %}",
    "tiny.txt": "a tiny corpus for the rows that build the model. " * 40,
    "hf_bert/config.json": json.dumps({"model_type": "bert"}),
    "hf_badjson/config.json": "{",
    "hf_yarn/config.json": json.dumps({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
    "hf_bias/config.json": json.dumps({**LLAMA, "attention_bias": True}),
    "hf_act/config.json": json.dumps({**LLAMA, "hidden_act": "gelu"}),
    "hf_relu/config.json": json.dumps({**GPT2, "activation_function": "relu"}),
    "hf_window/config.json": json.dumps({**QWEN3, "use_sliding_window": True}),
    "hf_dense/config.json": json.dumps({**QWEN3, "model_type": "qwen3_moe", "num_experts": 4,
                                        "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [0]}),
    "hf_junk/config.json": json.dumps(GPT2),
    "hf_junk/model.safetensors": "not a safetensors file",
    "hf_empty/config.json": json.dumps(GPT2),
    "hf_empty/model.safetensors": _safetensors({}),
    "hf_shape/config.json": json.dumps(GPT2),
    "hf_shape/model.safetensors": _safetensors({"wte.weight": (3, 3)}),
    "hf_extra": _hf_with_extra,
    "afile.txt": "not a run",
    "emptyrun/notes.txt": "a directory, but no run's",
    "badtoml/config.toml": "x = = 1",
    "badprofile/metrics.jsonl": "",
    "badprofile/profile/summary.json": "{",
    # a GPT-2's config.json without its weights: model.init's recipe checks come before any tensor is read
    "hf/config.json": '{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256, '
                      '"n_positions": 64}',
    "not_utf8.jsonl": b"\xff\xfe",
    "not_json.jsonl": "nope\n",
    "no_prompt.jsonl": '{"x": 1}\n',
    "no_rows.jsonl": "",
    "short.txt": "ab ab ab ab\nba ba\n",  # 18 train tokens: fewer than data.seq_len + 1 = 257
    "empty_messages.jsonl": '{"messages": []}\n',
    "bad_message.jsonl": '{"messages": ["hi"]}\n',
    "hf_bad_config/tokenizer.json": "{}\n",  # DataConfig.validate asks only that it exists
    "hf_bad_config/tokenizer_config.json": "{\n",
    # a `tokenizers` BPE file (tokenizers.Tokenizer(models.BPE(...)).save) without <|endoftext|>, and no config.json
    "hf_no_eot/tokenizer.json": json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}}),
}

# (site, argv, fragments of the one line). The key a site's error carries must be in the line as well.
SITES = [
    # kiln/models/config.py
    ("kiln/models/config.py:ModelConfig.resolve", [*M, "--model.preset=gpt5"], ["model.preset", "gpt5", "Presets:"]),
    ("kiln/models/config.py:ModelConfig.resolve", [*M, "--model.n_layer=-1"], ["model.n_layer", "≥ 1"]),
    # kiln/models/family.py: the recipe's parts
    ("kiln/models/family.py:Family.check_parts", [*M, "--model.mlp=relu3"], ["model.mlp='relu3'", "relu2"]),
    ("kiln/models/family.py:Family.check_parts", [*M, "--model.logit_softcap=-1"],
     ["model.logit_softcap=-1", "0 for none"]),
    ("kiln/models/config.py:ModelConfig.check", [*M, "--model.preset=llama-125m", "--model.n_kv_head=5"],
     ["model.n_head=12", "n_kv_head=5"]),
    ("kiln/models/config.py:ModelConfig.check", [*M, "--model.init=weights"], ["model.init='weights'", "hf:DIR"]),
    ("kiln/models/config.py:ModelConfig.check", [*M, "--model.dropout=1.5"], ["model.dropout", "1.5"]),
    ("kiln/models/config.py:ModelConfig.check", [*M, "--model.init=hf:hf", "--model.zero_init_proj=true"],
     ["model.zero_init_proj=true", "model.init=hf:hf", "drop --model.zero_init_proj"]),
    # model.init's checkpoint against the recipe keys (tests/interop/test_hf_recipe.py: word for word)
    ("kiln/models/config.py:with_training_fields", [*T, "--model.init=hf:hf", "--model.mlp=relu2"],
     ["model.mlp='relu2' with model.init=hf:hf", "MLP is 'gelu'", "drop --model.mlp"]),
    ("kiln/models/config.py:with_training_fields", [*T, "--model.init=hf:hf", "--model.qk_norm=true"],
     ["model.qk_norm=true with model.init=hf:hf", "has no QK-norm", "drop --model.qk_norm"]),
    # kiln/data/config.py
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.source="], ["data.source is empty", "'stdlib'"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.format=csv"], ["data.format='csv'", "use one of"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.text_field="], ["data.text_field", "'text'"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.pattern="], ["data.pattern", "glob"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.tokenizer=hf:no such dir"],
     ["data.tokenizer='hf:no such dir'", "tokenizer.json does not exist"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.tokenizer=words"], ["data.tokenizer='words'", "hf:DIR"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.tokenizer=bpe", "--data.vocab_size=100"],
     ["data.vocab_size=100", "at least 257"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.val_fraction=1"], ["data.val_fraction=1"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.seq_len=-2"], ["data.seq_len=-2"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.seed=-1"], ["data.seed=-1"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.prefetch=-1"], ["data.prefetch=-1"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.workers=-1"], ["data.workers=-1"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.shard_tokens=0"], ["data.shard_tokens=0"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.tokenizer_sample_bytes=0"],
     ["data.tokenizer_sample_bytes=0"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.on_bad_record=ignore"],
     ["data.on_bad_record='ignore'"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.format=tokens", "--data.vocab_size=1"],
     ["data.vocab_size=1", "data.format=tokens"]),
    ("kiln/data/config.py:DataConfig.validate", [*M, "--data.format=tokens", "--data.document_mask=true"],
     ["data.document_mask=true", "end-of-text id", "--data.tokenizer=hf:DIR"]),
    # kiln/data/loader.py, tokenizer.py, chat.py: refusals once the data is read
    ("kiln/data/loader.py:_check_length", D, ["data.source='short.txt', train split: 18 tokens are fewer than "
                                              "seq_len + 1 = 257", "lower data.seq_len"]),
    ("kiln/data/tokenizer.py:BPETokenizer.from_hf", [*D, "--data.tokenizer=hf:hf_no_eot"],
     ["hf_no_eot: its tokenizer has no '<|endoftext|>' and config.json no eos_token_id"]),
    ("kiln/data/chat.py:_read", [*M, "--data.records=chat", "--data.tokenizer=hf:hf_bad_config"],
     ["hf_bad_config/tokenizer_config.json is not valid JSON", "restore it"]),
    ("kiln/data/chat.py:check_messages", ["sample", "run", "--max-new-tokens=1", "--prompt-file=empty_messages.jsonl"],
     ["empty_messages.jsonl:1: \"messages\" must be a non-empty list"]),
    ("kiln/data/chat.py:check_messages", ["sample", "run", "--max-new-tokens=1", "--prompt-file=bad_message.jsonl"],
     ["bad_message.jsonl:1: message 0 must be an object with a string \"role\""]),
    # kiln/data/mix.py
    ("kiln/data/mix.py:check_mix", [*M, "mix_and_source.toml"], ["data.source='a.txt' and [[data.mix]]"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_not_table.toml"], ["[[data.mix]] entry 1 is 1", "a table"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_unknown_key.toml"], ["[[data.mix]] entry 1", "['wieght']"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_no_source.toml"], ["[[data.mix]] entry 1 has no source"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_zero_weight.toml"], ["[[data.mix]] entry 1: weight=0"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_name_number.toml"], ["[[data.mix]] entry 1: name=3"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_bpe_tokens.toml"], ["data.tokenizer=bpe", "hf:DIR"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_same_name.toml"], ["[[data.mix]]: the name(s) ['a']"]),
    ("kiln/data/mix.py:check_mix", [*M, "mix_records.toml"], ["[[data.mix]] mixes records ['chat', 'text']"]),
    # kiln/data/sft.py: chat records' keys
    ("kiln/data/sft.py:check_chat", [*M, "--data.records=dialog"], ["data.records='dialog' is unknown"]),
    ("kiln/data/sft.py:check_chat", [*M, "--data.train_on=prompt"], ["data.train_on='prompt' is unknown"]),
    ("kiln/data/sft.py:check_chat", [*M, "--data.records=chat", "--data.format=tokens", "--data.vocab_size=300"],
     ["data.records=chat with data.format=tokens"]),
    ("kiln/data/sft.py:check_chat", [*M, "--data.records=chat", "--data.tokenizer=bpe"],
     ["data.records=chat with data.tokenizer=bpe", "hf:DIR"]),
    ("kiln/data/sft.py:chat_template_for", [*M, "--data.records=chat"],
     ["data.tokenizer='bytes' has no chat template", "data.chat_template=chatml"]),
    ("kiln/data/sft.py:chat_template_for", [*M, "--data.records=chat", "--data.chat_template=x.txt"],
     ["data.chat_template='x.txt' is neither chatml nor an existing .jinja file"]),
    ("kiln/data/sft.py:chat_template_for", [*M, "--data.records=chat", "--data.chat_template=bad.jinja"],
     ["bad.jinja: the chat template does not parse"]),
    # kiln/train/precision.py, logging.py, checkpoint.py
    ("kiln/train/precision.py:PrecisionConfig.validate", [*M, "--precision.mode=fp12"], ["precision.mode='fp12'"]),
    ("kiln/train/precision.py:PrecisionConfig.validate", [*M, "--precision.growth_factor=1"],
     ["precision.growth_factor > 1"]),
    ("kiln/train/precision.py:PrecisionConfig.validate", [*M, "--precision.growth_interval=0"],
     ["precision.growth_interval"]),
    ("kiln/train/logging.py:LogConfig.validate", [*M, "--log.interval=0"], ["log.interval"]),
    ("kiln/train/logging.py:LogConfig.validate", [*M, "--log.progress=loud"], ["log.progress='loud'"]),
    ("kiln/train/checkpoint.py:CheckpointConfig.validate", [*M, "--checkpoint.interval=-1"], ["checkpoint.interval"]),
    ("kiln/train/checkpoint.py:CheckpointConfig.validate", [*M, "--checkpoint.every_minutes=-1"],
     ["checkpoint.every_minutes"]),
    ("kiln/train/checkpoint.py:CheckpointConfig.validate", [*M, "--checkpoint.on_error=ignore"],
     ["checkpoint.on_error='ignore'"]),
    ("kiln/train/checkpoint.py:CheckpointConfig.validate", [*M, "--checkpoint.keep_last=0"], ["checkpoint.keep_last"]),
    # kiln/perf/hardware.py: the Triton refusal on a CPU (a RuntimeError's traceback before #37)
    ("kiln/perf/hardware.py:resolve_kernels", ["train", "--model.preset=tiny", "--train.device=cpu",
                                               "--data.source=nowhere.txt", "--train.kernels=triton"],
     ["train.kernels='triton' runs on CUDA", "TRITON_INTERPRET=1"]),
    ("kiln/models/catalog.py:family", [*M, "--model.arch=gtp2"], ["model.arch='gtp2'", "did you mean 'gpt2'"]),
    # kiln/models/lora.py
    ("kiln/models/lora.py:LoraConfig.validate", [*M, "--lora.rank=-1"], ["lora.rank=-1", "--lora.rank=8"]),
    ("kiln/models/lora.py:LoraConfig.validate", [*M, "--lora.rank=4", "--lora.alpha=0"], ["lora.alpha=0.0"]),
    ("kiln/models/lora.py:LoraConfig.validate", [*M, "--lora.rank=4", "--lora.dropout=1"], ["lora.dropout=1.0"]),
    ("kiln/models/lora.py:LoraConfig.validate", [*M, "--lora.rank=4", "--lora.targets=,"], ["lora.targets is empty"]),
    ("kiln/models/lora.py:LoraConfig.validate", [*M, "--lora.rank=4", "--lora.init=x"], ["lora.init='x'", "peft:DIR"]),
    ("kiln/models/lora.py:LoraConfig.validate", [*M, "--lora.dropout=0.1"], ["lora.rank=0 builds none"]),
    ("kiln/models/lora.py:check_run", [*P2, "--lora.rank=4", "--parallel.tp=2"], ["parallel.tp=2", "fsdp"]),
    ("kiln/models/lora.py:check_run", [*M, "--lora.rank=4", "--precision.mode=fp8"], ["precision.mode=fp8"]),
    ("kiln/models/lora.py:resolve_targets", ["train", "--model.preset=tiny", "--train.device=cpu",
                                             "--data.source=nowhere.txt", "--lora.rank=4", "--lora.targets=q_proj"],
     ["lora.targets='q_proj'", "valid: attn, mlp, all, attn.qkv"]),
    ("kiln/models/lora.py:resolve_targets", ["train", "--model.preset=qwen3-moe-nano", "--train.device=cpu",
                                             "--data.source=nowhere.txt", "--lora.rank=4"],
     ["MoE experts", "--lora.targets=attn"]),
    # kiln/models/values.py
    ("kiln/models/values.py:check_values", [*M, "--model.preset=llama-125m", "--model.rope_theta=-1"],
     ["model.rope_theta=-1", "10000"]),
    ("kiln/models/values.py:check_values", [*M, "--model.norm_eps=-1"], ["model.norm_eps=-1", "1e-5"]),
    ("kiln/models/values.py:refuse_replaced", [*M, "--model.n_layer=0"], ["--model.n_layer=0 would be ignored"]),
    # kiln/memory: offload, devices, planner, recompute
    ("kiln/memory/offload.py:parse_blocks", [*M, "--memory.offload_blocks=abc"], ["memory.offload_blocks='abc'"]),
    ("kiln/memory/offload.py:parse_blocks", [*M, "--memory.offload_blocks=0-99"], ["memory.offload_blocks='0-99'",
                                                                                   "blocks run 0..5"]),
    ("kiln/memory/devices.py:get_device", [*M, "--device=H900"], ["unknown device 'H900'", "Known:"]),
    ("kiln/memory/planner.py:PlanConfig.validate", [*M, "--plan.global_batch_tokens=-1"],
     ["plan.global_batch_tokens", "-1"]),
    ("kiln/memory/planner.py:search", ["plan", "--model.preset=tiny", "--gpus=2", "--interconnect=carrier-pigeon"],
     ["interconnect 'carrier-pigeon'", "nvlink4"]),
    ("kiln/memory/planner.py:search", ["plan", "--model.preset=tiny", "--global-batch-tokens=100"],
     ["--global-batch-tokens=100", "data.seq_len=256"]),
    ("kiln/memory/planner.py:search", ["plan", "--model.preset=tiny", "--gpus=3", "--no-model-parallel",
                                       "--global-batch-tokens=512"], ["--global-batch-tokens=512", "3 GPUs"]),
    ("kiln/memory/recompute.py:solve_budget", [*M, "--memory.recompute=budget", "--memory.recompute_budget=1KiB"],
     ["memory.recompute_budget=1.00 KiB", "raise the budget"]),
    ("kiln/memory/estimate.py:parse_bytes", [*M, "--plan.memory=lots"], ["plan.memory='lots'", "24GiB"]),
    ("kiln/memory/estimate.py:parse_bytes", [*M, "--memory.recompute=budget", "--memory.recompute_budget=6 GiBs"],
     ["memory.recompute_budget='6 GiBs'", "512MiB"]),
    ("kiln/memory/estimate.py:parse_bytes", ["plan", "--model.preset=tiny", "--memory=lots"], ["--memory='lots'"]),
    # kiln/memory/levers.py
    ("kiln/memory/levers.py:MemoryConfig.validate", [*M, "--memory.recompute=al"], ["memory.recompute='al'"]),
    ("kiln/memory/levers.py:MemoryConfig.validate", [*M, "--memory.recompute_every=0"], ["memory.recompute_every"]),
    ("kiln/memory/levers.py:MemoryConfig.validate", [*M, "--memory.recompute=budget"],
     ["memory.recompute_budget", "6GiB"]),
    ("kiln/memory/levers.py:MemoryConfig.validate", [*M, "--memory.chunked_loss=-1"], ["memory.chunked_loss", "-1"]),
    ("kiln/memory/levers.py:precision_for", [*M, "--device=V100-32GB", "--precision.mode=fp8"],
     ["precision.mode='fp8'", "use bf16"]),
    ("kiln/memory/levers.py:precision_for", [*M, "--device=V100-32GB", "--precision.mode=bf16"],
     ["precision.mode='bf16'", "V100", "or auto"]),
    ("kiln/memory/levers.py:for_rank", [*P2, "--parallel.cp=2", "--data.seq_len=15"],
     ["parallel.cp=2", "data.seq_len=15", "divides"]),
    # kiln/numerics/config.py
    ("kiln/numerics/config.py:NumericsConfig.validate", [*M, "--numerics.spike_policy=panic"],
     ["numerics.spike_policy='panic'", "use one of"]),
    ("kiln/numerics/config.py:NumericsConfig.validate", [*M, "--numerics.rollback_from=tape"],
     ["numerics.rollback_from='tape'", "'disk'"]),
    ("kiln/numerics/config.py:NumericsConfig.validate", [*M, "--numerics.spike_threshold=0"], ["spike_threshold"]),
    ("kiln/numerics/config.py:NumericsConfig.validate", [*M, "--numerics.spike_window=2"], ["spike_window", "≥ 3"]),
    ("kiln/numerics/config.py:NumericsConfig.validate", [*M, "--numerics.rollback_lr_factor=2"],
     ["numerics.rollback_lr_factor", "(0, 1]"]),
    ("kiln/numerics/config.py:NumericsConfig.validate", [*M, "--numerics.max_rollbacks=0"],
     ["numerics.max_rollbacks", "≥ 1"]),
    ("kiln/numerics/config.py:NumericsConfig.validate", [*M, "--numerics.max_nonfinite_steps=-1"],
     ["numerics.max_nonfinite_steps", "≥ 0"]),
    # kiln/train/schedule.py
    ("kiln/train/schedule.py:ScheduleConfig.validate", [*M, "--schedule.name=zigzag"], ["schedule.name='zigzag'"]),
    ("kiln/train/schedule.py:ScheduleConfig.validate", [*M, "--schedule.warmup_steps=-1"],
     ["schedule.warmup_steps", "-1"]),
    ("kiln/train/schedule.py:ScheduleConfig.validate", [*M, "--schedule.min_lr_ratio=2"], ["schedule.min_lr_ratio"]),
    ("kiln/train/schedule.py:ScheduleConfig.validate", [*M, "--schedule.decay_fraction=0"],
     ["schedule.decay_fraction"]),
    ("kiln/train/schedule.py:ScheduleConfig.validate", [*M, "--schedule.total_steps=-1"], ["schedule.total_steps"]),
    ("kiln/train/schedule.py:ScheduleConfig.validate", [*M, "--schedule.gamma=0"], ["schedule.step_size"]),
    # kiln/train/optim.py
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.name=adamz"], ["optim.name='adamz'"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.lr=0"], ["optim.lr", "> 0"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.beta2=1"], ["optim.beta2", "[0, 1)"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.eps=0"], ["optim.weight_decay", "optim.eps > 0"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.clip_mode=hard"], ["optim.clip_mode='hard'"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.clip_percentile=0"], ["optim.clip_percentile"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.clip_history=0"], ["optim.clip_history"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.implementation=fast"],
     ["optim.implementation='fast'", "foreach"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.lr_scaling=cubic"], ["optim.lr_scaling='cubic'"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.lr_scaling=linear", "--optim.reference_batch_tokens=0"],
     ["optim.reference_batch_tokens"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.offload=disk"], ["optim.offload='disk'"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.name=muon", "--optim.muon_lr=0"], ["optim.muon_lr"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.name=muon", "--optim.muon_ns_steps=0"],
     ["optim.muon_ns_steps=0", "--optim.muon_ns_steps=5"]),
    ("kiln/train/optim.py:OptimConfig.validate", [*M, "--optim.name=muon", "--optim.offload=host"],
     ["optim.offload=host", "--optim.offload=none with muon"]),
    # kiln/train/settings.py: the [train] section
    ("kiln/train/settings.py:TrainConfig.validate", [*M, "--train.micro_batch_size=0"], ["train.micro_batch_size", "≥ 1"]),
    ("kiln/train/settings.py:TrainConfig.validate", [*M, "--train.max_steps=-1"], ["train.max_steps", "≥ 0"]),
    ("kiln/train/settings.py:TrainConfig.validate", [*M, "--train.max_steps=0", "--train.time_budget=0"],
     ["train.max_steps=0", "--train.time_budget=SECONDS"]),
    ("kiln/train/settings.py:TrainConfig.validate", [*M, "--train.stop_at_val_loss=3", "--train.eval_interval=0"],
     ["train.stop_at_val_loss=3", "--train.eval_interval=N"]),
    ("kiln/train/settings.py:TrainConfig.validate", [*M, "--train.device=tpu"], ["train.device='tpu'", "cuda:N"]),
    ("kiln/train/settings.py:TrainConfig.validate", [*M, "--train.global_batch_size=3", "--train.micro_batch_size=2"],
     ["train.global_batch_size=3", "train.micro_batch_size=2"]),
    ("kiln/train/settings.py:TrainConfig.validate", [*M, '--train.eval_tasks=[""]'], ["train.eval_tasks=['']"]),
    ("kiln/train/settings.py:TrainConfig.validate", [*M, "--train.kernels=cuda"], ["train.kernels='cuda'"]),
    ("kiln/train/settings.py:parse_duration", [*M, "--train.max_time=soon"], ["train.max_time='soon'", "3h50m"]),
    # kiln/train: refusals once the model is built (TD: no step runs)
    ("kiln/train/budget.py:TimeBudget.__init__", [*TD, "--train.max_steps=0", "--train.time_budget=10",
                                                  "--schedule.warmup_steps=0"],
     ["train.max_steps=0 measures steps 1-10", "schedule.warmup_steps ≥ 10 (got 0)"]),
    ("kiln/train/pipeline.py:prepare_model", [*TD, "--memory.chunked_loss=64", "--model.logit_softcap=30"],
     ["model.logit_softcap=30", "drop --memory.chunked_loss"]),
    # kiln/run: `kiln train`'s and `kiln sample`'s refusals
    ("kiln/run/builder.py:pick_device", [*T, "--train.device=cuda"], ["train.device asks for CUDA", "--train.device=cpu"]),
    ("kiln/run/oom.py:ram_check", [*T, "--model.preset=llama-70b"],  # ~1 TB predicted: more than any machine here
     ["the estimator predicts a peak of", "pass --force"]),
    ("kiln/run/device_levers.py:device_levers", [*T, "--parallel.strategy=fsdp", "--parallel.cpu_offload=true"],
     ["parallel.cpu_offload", "train.device is the CPU"]),
    ("kiln/run/lm.py:resolve_model", [*TD, "--model.vocab_size=10"], ["model.vocab_size=10", "--model.vocab_size=256"]),
    ("kiln/run/lm.py:plan_memory", [*TD, "--plan.memory=1KiB"], ["nothing fits in 1.00 KiB", "raise plan.memory"]),
    ("kiln/run/lm.py:LMParts.loader", [*TD, "--data.val_fraction=0.01"],
     ["the validation split holds 21 tokens", "raise data.val_fraction"]),
    ("kiln/run/sample.py:read_prompt_file", ["sample", "run", "--prompt-file=not_utf8.jsonl"],
     ["not_utf8.jsonl is not UTF-8 text"]),
    ("kiln/run/sample.py:read_prompt_file", ["sample", "run", "--prompt-file=not_json.jsonl"],
     ["not_json.jsonl:1: not a JSON object"]),
    ("kiln/run/sample.py:read_prompt_file", ["sample", "run", "--prompt-file=no_prompt.jsonl"],
     ["no_prompt.jsonl:1: needs \"prompt\""]),
    ("kiln/run/sample.py:read_prompt_file", ["sample", "run", "--prompt-file=no_rows.jsonl"],
     ["no_rows.jsonl holds no prompts"]),
    # kiln/parallel/layout.py
    ("kiln/parallel/layout.py:check_degrees", [*M, "--parallel.tp=0"], ["parallel.tp=0", "≥ 1"]),
    ("kiln/parallel/layout.py:check_degrees", [*P2, "--parallel.tp=3"],
     ["2 processes", "parallel.tp=3", "multiple of 3"]),
    ("kiln/parallel/layout.py:check_degrees", [*M, "--ranks=2", "--parallel.strategy=none"],
     ["parallel.strategy=none", "--parallel.strategy=ddp"]),
    ("kiln/parallel/layout.py:check_degrees",
     [*M, "--ranks=2", "--parallel.strategy=none", "--parallel.cp=2"], ["parallel.cp=2", "--parallel.strategy=fsdp"]),
    # kiln/parallel/context.py: what `kiln train` with parallel.cp > 1 is built for (kiln memory models more)
    ("kiln/parallel/context.py:check_context_parallel", [*T, "--parallel.cp=2", "--parallel.strategy=ddp"],
     ["parallel.cp=2", "--parallel.strategy=fsdp"]),
    ("kiln/parallel/context.py:check_context_parallel", [*T, "--parallel.cp=2", "--parallel.strategy=fsdp",
                                                         "--parallel.tp=2"], ["parallel.tp=2", "--parallel.tp=1"]),
    ("kiln/parallel/context.py:check_context_parallel", [*T, "--model.preset=qwen3-moe-nano", "--parallel.cp=2",
                                                         "--parallel.strategy=fsdp"],
     ["parallel.cp=2", "mixture of experts", "--parallel.cp=1"]),
    ("kiln/parallel/context.py:check_context_parallel", [*T, "--parallel.cp=2", "--parallel.strategy=fsdp",
                                                         "--data.seq_len=30"], ["data.seq_len=30", "divisible by 4"]),
    ("kiln/parallel/layout.py:check_degrees", [*M, "--parallel.sequence_parallel=true"],
     ["parallel.sequence_parallel", "--parallel.tp > 1"]),
    ("kiln/parallel/layout.py:check_degrees", [*M, "--ranks=2", "--parallel.strategy=zero1",
                                                     "--parallel.tp=2"], ["parallel.strategy=zero1", "fsdp or ddp"]),
    ("kiln/parallel/layout.py:check_degrees", [*M, "--ranks=2", "--parallel.strategy=zero1",
                                                     "--parallel.pp=2"], ["parallel.pp", "zero1"]),
    # expert parallelism's bad layouts (tests/parallel/test_expert_layout.py: the same line from kiln train and plan)
    ("kiln/parallel/layout.py:check_experts", [*M, "--ranks=2", "--parallel.strategy=fsdp", "--parallel.ep=2"],
     ["parallel.ep=2", "model.arch=gpt2 is dense", "--parallel.ep=1"]),
    ("kiln/parallel/layout.py:check_experts", [*M, "--model.preset=qwen3-moe-nano", "--ranks=3",
                                                     "--parallel.strategy=fsdp", "--parallel.ep=3"],
     ["parallel.ep=3 does not divide model.n_experts = 8"]),
    ("kiln/parallel/layout.py:check_ep_ranks", [*M, "--model.preset=qwen3-moe-nano", "--ranks=2",
                                                      "--parallel.strategy=fsdp", "--parallel.ep=4"],
     ["parallel.ep=4 does not divide the 2 data-parallel ranks", "launch 4× more processes"]),
    ("kiln/parallel/layout.py:_check_ep", [*M, "--model.preset=qwen3-moe-nano", "--ranks=2",
                                                 "--parallel.strategy=zero1", "--parallel.ep=2"],
     ["parallel.ep with parallel.strategy=zero1", "fsdp or ddp"]),
    ("kiln/parallel/layout.py:ParallelPlan.build", [*M, "--parallel.pp_schedule=zigzag"],
     ["parallel.pp_schedule='zigzag'"]),
    ("kiln/parallel/layout.py:ParallelPlan.build", [*P2, "--parallel.pp=2", "--parallel.pp_microbatches=3",
                                                          "--train.micro_batch_size=4"], ["parallel.pp_microbatches=3"]),
    ("kiln/parallel/layout.py:ParallelPlan.build", [*P2, "--parallel.pp=2", "--parallel.pp_schedule=1f1b",
                                                          "--parallel.pp_microbatches=1"], ["1f1b", "gpipe"]),
    ("kiln/parallel/layout.py:_check_model", [*P2, "--parallel.pp=2", "--model.n_layer=1"],
     ["parallel.pp splits 1 blocks"]),
    ("kiln/parallel/layout.py:_check_model", [*P2, "--parallel.tp=2", "--model.n_head=3", "--model.d_model=48"],
     ["parallel.tp=2 does not divide"]),
    # kiln/models: the parts' and families' checks of a resolved config (costs.py, family.py, gpt2.py)
    ("kiln/models/costs.py:MLP.check", [*M, "--model.n_experts=8"], ["model.n_experts=8", "model.arch=qwen3_moe"]),
    ("kiln/models/costs.py:MoEMLP.check", [*M, "--model.preset=qwen3-moe-nano", "--model.n_experts_active=9"],
     ["model.n_experts_active=9", "1 ≤ active ≤ experts"]),
    ("kiln/models/costs.py:MoEMLP.check", [*M, "--model.preset=qwen3-moe-nano", "--model.moe_z_coef=-1"],
     ["model.moe_z_coef must be ≥ 0"]),
    ("kiln/models/position_costs.py:RotaryPositions.check", [*M, "--model.preset=llama-125m", "--model.head_dim=63"],
     ["even head dimension", "model.head_dim = 63"]),
    ("kiln/models/family.py:Family.complete", [*M, "--model.d_model=100", "--model.n_head=3"],
     ["model.d_model=100", "model.n_head=3", "model.head_dim"]),
    ("kiln/models/family.py:Family.check", [*M, "--model.n_kv_head=2"], ["model.n_kv_head", "set model.n_kv_head=0"]),
    ("kiln/models/family.py:Family.check", [*M, "--model.preset=llama-125m", "--model.rope_scaling=[1,2,3]"],
     ["model.rope_scaling=(1, 2, 3)", "arch='llama' only"]),
    ("kiln/models/gpt2.py:_check", [*M, "--model.head_dim=8"], ["n_head × head_dim (6 × 8)", "leave model.head_dim at 0"]),
    # a Hugging Face directory kiln cannot read (`kiln sample hf:DIR`; `kiln train --model.init=hf:DIR` reads it alike)
    ("kiln/models/registry.py:by_hf_model_type", ["sample", "hf:hf_bert"],
     ["hf_bert/config.json: model_type='bert' is not one kiln reads", "'llama'"]),
    ("kiln/models/llama.py:rope_from_hf", ["sample", "hf:hf_yarn"], ["rope_scaling of type 'yarn'"]),
    ("kiln/models/llama.py:shape_from_hf", ["sample", "hf:hf_bias"], ["attention_bias", "kiln's llama block"]),
    ("kiln/models/llama.py:shape_from_hf", ["sample", "hf:hf_act"], ["hidden_act='gelu'", "SwiGLU (silu)"]),
    ("kiln/models/gpt2.py:from_hf", ["sample", "hf:hf_relu"], ["activation_function='relu'", "gelu_new"]),
    ("kiln/models/qwen3.py:check_window", ["sample", "hf:hf_window"], ["use_sliding_window=true"]),
    ("kiln/models/qwen3_moe.py:from_hf", ["sample", "hf:hf_dense"], ["mlp_only_layers", "has experts"]),
    ("kiln/interop/hf.py:_read_json", ["sample", "hf:hf_badjson"], ["hf_badjson/config.json is not valid JSON"]),
    ("kiln/interop/hf.py:_read_tensors", ["sample", "hf:hf_junk"],
     ["hf_junk/model.safetensors does not load as safetensors", "copy it again"]),
    ("kiln/interop/hf.py:_take", ["sample", "hf:hf_empty"],
     ["no tensor 'transformer.wte.weight'", "does not match its config.json"]),
    ("kiln/interop/hf.py:_take", ["sample", "hf:hf_shape"], ["wte.weight has shape (3, 3), config.json implies (300, 16)"]),
    ("kiln/interop/hf.py:read_hf", ["sample", "hf:hf_extra"], ["tensors kiln has no place for: extra.weight"]),
    # kiln/numerics/faults.py: the faults.* keys, as text and against the built model
    ("kiln/numerics/faults.py:FaultsConfig.validate", [*M, "--faults.spike=-1"], ["faults.spike must be a step ≥ 1"]),
    ("kiln/numerics/faults.py:FaultsConfig.validate", [*M, "--faults.data_delay_ms=-1"],
     ["faults.data_delay_ms must be ≥ 0"]),
    ("kiln/numerics/faults.py:parse_spec", [*M, "--faults.nan_forward=xyz"], ["faults.nan_forward='xyz'", "MODULE@STEP"]),
    ("kiln/numerics/faults.py:parse_spec", [*M, "--faults.inf_backward=blocks.0@0"],
     ["faults.inf_backward='blocks.0@0'", "1-based"]),
    ("kiln/numerics/faults.py:_module", [*TD, "--faults.nan_forward=blocks.9.mlp@1"],
     ["no module 'blocks.9.mlp'", "did you mean 'blocks.5.mlp'"]),
    ("kiln/numerics/faults.py:FaultInjector.__init__", [*TD, "--faults.inf_backward=embed@1"],
     ["faults.inf_backward='embed@1'", "blocks.1.attn"]),
    # kiln/perf: train.compile, train.cpu_linear, precision.mode on this device, `kiln estimate`'s numbers
    ("kiln/perf/compile.py:compile_setting", [*M, "--train.compile=maybe"], ["train.compile='maybe'", "auto, true"]),
    ("kiln/perf/cpu_linear.py:cpu_linear_setting", [*M, "--train.cpu_linear=mkl"], ["train.cpu_linear='mkl'"]),
    ("kiln/perf/allocator.py:allocator_setting", [*M, "--train.cpu_allocator=jemalloc"],
     ["train.cpu_allocator='jemalloc'"]),
    ("kiln/perf/cpu_linear.py:decide_cpu_linear", [*TD, "--train.cpu_linear=onednn", "--precision.mode=bf16"],
     ["train.cpu_linear=onednn", "--train.cpu_linear=auto or torch"]),
    ("kiln/perf/hardware.py:_checked", [*T, "--precision.mode=tf32"], ["precision.mode='tf32' needs a CUDA device"]),
    ("kiln/perf/hardware.py:_checked", [*T, "--precision.mode=fp8"], ["precision.mode='fp8'", "use bf16"]),
    ("kiln/perf/estimate.py:parse_count", [*E, "--tokens=lots"], ["--tokens='lots'", "2e12, 2T"]),
    ("kiln/perf/estimate.py:parse_count", [*E, "--tokens=0"], ["--tokens='0' must be a positive, finite count"]),
    ("kiln/perf/estimate.py:training_estimate", [*E, "--tokens=1B", "--mfu=2"], ["MFU must be in (0, 1]", "--mfu=0.4"]),
    ("kiln/perf/estimate.py:training_estimate", [*E, "--tokens=1B", "--pue=0.5"], ["PUE is at least 1", "--pue"]),
    # kiln/report/runs.py: `kiln report` of something that is not a run
    ("kiln/report/runs.py:read_run", ["report", "afile.txt", "--out=r.html"],
     ["afile.txt is not a kiln run directory (it is a file)"]),
    ("kiln/report/runs.py:read_run", ["report", "emptyrun", "--out=r.html"], ["neither metrics.jsonl nor config.toml"]),
    ("kiln/report/runs.py:read_run", ["report", "badtoml", "--out=r.html"], ["badtoml/config.toml is not valid TOML"]),
    ("kiln/report/runs.py:read_run", ["report", "badprofile", "--out=r.html"],
     ["profile/summary.json is not valid JSON"]),
    # kiln/parallel/config.py, strategy.py: the parallel section's own keys
    ("kiln/parallel/config.py:ParallelConfig.validate", [*M, "--parallel.backend=mpi"], ["parallel.backend='mpi'"]),
    ("kiln/parallel/config.py:ParallelConfig.validate", [*M, "--parallel.cpu_offload=true"],
     ["parallel.cpu_offload", "--parallel.strategy=fsdp"]),
    ("kiln/parallel/config.py:ParallelConfig.validate", [*M, "--parallel.timeout=0"], ["parallel.timeout", "got 0.0"]),
    ("kiln/parallel/config.py:ParallelConfig.validate", [*M, "--parallel.straggler_intervals=-1"],
     ["parallel.straggler_intervals ≥ 0 (got -1)"]),
    ("kiln/parallel/strategy.py:strategy", [*M, "--parallel.strategy=horovod"], ["parallel.strategy='horovod'"]),
    # kiln/parallel/world.py: a model-parallel run started without torchrun
    ("kiln/parallel/world.py:init_world", [*T, "--parallel.tp=2", "--parallel.strategy=fsdp"],
     ["parallel.tp=2 × parallel.pp=1 splits the model over 2 processes", "--nproc_per_node=2"]),
]

# Sites with fewer rows than raises, each with how many raises have no row (ALL: every one) and why.
ALL = 99
ALLOWED = {
    "kiln/interop/hf.py:refuse_unmapped_parts": (
        ALL, "`kiln export RUN --hf OUT` of a run trained with a part the Hub has no form for: it needs a trained "
             "checkpoint; tests/models/test_recipe.py checks each message word for word and that nothing is written"),
    "kiln/config.py:load_config": (
        ALL, "holds 6 ConfigErrors of the config file (tests/cli/test_bad_input.py) and the re-raise of a section's "
             "KilnError as a ConfigError (same key, value and fix)"),
    "kiln/perf/allocator.py:decide_allocator": (
        ALL, "train.cpu_allocator=tuned off glibc (musl, macOS): not reachable on a glibc host; "
             "tests/perf/test_allocator.py checks the line with glibc hidden"),
    "kiln/config.py:validate": (
        ALL, "re-raises a section's KilnError as a ConfigError with the same key, value and fix"),
    "kiln/models/config.py:ModelConfig.padded_vocab": (
        ALL, "`kiln` sets model.vocab_size from the tokenizer before any caller asks for it: a library caller's "
             "ModelConfig reaches it"),
    "kiln/models/config.py:ModelConfig.check": (
        1, "a size below 1: resolve() names a negative one first (row above) and fills 0 from the preset; a direct "
           "check() reaches it"),
    "kiln/models/values.py:check_values": (
        1, "a negative model.vocab_size: resolve() names every negative size first (row above)"),
    "kiln/memory/recompute.py:plan_for": (
        ALL, "memory.recompute and memory.recompute_budget are checked by MemoryConfig.validate first (rows above); a "
             "library caller of the estimator reaches it"),
    "kiln/memory/estimate.py:recompute_plan": (
        ALL, "memory.recompute and memory.recompute_every are checked by MemoryConfig.validate first (rows above); a "
             "library caller of the estimator reaches it (tests/memory/test_memory_refusals.py)"),
    "kiln/memory/estimate.py:optimizer_state_bytes": (
        ALL, "optim.name is checked by OptimConfig.validate first (row above); a library caller of the estimator "
             "reaches it (tests/memory/test_memory_refusals.py)"),
    "kiln/memory/planner.py:fit_time_model": (
        ALL, "`kiln plan --calibrate` measures steps of two sizes, which tell the two times apart; a library caller's "
             "steps of one size reach it (tests/memory/test_memory_refusals.py)"),
    "kiln/memory/recompute.py:apply_recompute": (
        ALL, "kiln's runs build the plan from memory.* checked first (recompute_plan, solve_budget); a library "
             "caller's plan or model reaches them (tests/memory/test_memory_refusals.py)"),
    "kiln/memory/chunked_loss.py:ChunkedLMLoss.__init__": (
        ALL, "memory.chunked_loss below 0 is refused by MemoryConfig.validate (row above) and 0 is off; a library "
             "caller's ChunkedLMLoss(0) reaches it (tests/memory/test_memory_refusals.py)"),
    "kiln/data/tokenizer.py:build_tokenizer": (
        ALL, "data.tokenizer is checked by DataConfig.validate first (rows above); a library caller reaches it"),
    "kiln/kernels/utils.py:check_device": (
        ALL, "kiln's runs refuse train.kernels=triton on a CPU in resolve_kernels (row above); a library call of a "
             "kiln.kernels op on a CPU tensor reaches it"),
    "kiln/perf/hardware.py:resolve_kernels": (
        3, "an unknown train.kernels is refused by TrainConfig.validate first; no triton package, or a GPU older "
           "than Ampere, is not this machine (tests/kernels/test_kernels_apply.py fakes the old GPU)"),
    "kiln/models/lora.py:apply_lora": (
        ALL, "a model that already holds adapters: kiln builds a fresh one; a library caller (kiln.fit given an "
             "adapted model twice) reaches it (tests/models/test_lora.py)"),
    "kiln/models/lora.py:_adapt": (
        ALL, "a target that is no nn.Linear: kiln's families list linears only; a library caller reaches it"),
    "kiln/models/lora.py:_user_targets": (
        ALL, "kiln.fit's model of the user's (tests/models/test_lora.py checks the line word for word)"),
    "kiln/evaluate/score.py:training_tasks": (
        ALL, "train.eval_tasks with parallel.cp > 1 or sequence parallelism needs torchrun (a launch: kept out of "
             "this table's time); tests/evaluate/test_harness_encoding.py calls it with such a plan"),
    "kiln/parallel/context.py:SequenceShard.set_length": (
        ALL, "data.seq_len is checked by check_context_parallel before the run (row above); a library caller's "
             "batch of another length reaches it"),
    "kiln/parallel/context.py:apply_context_parallel": (
        ALL, "kiln.fit of a model of the user's with parallel.cp > 1 under torchrun (a launch: kept out of this "
             "table's time)"),
    "kiln/train/optim.py:_implementation": (
        ALL, "kiln's own models hold floating-point parameters on CPU or CUDA; a fit() model elsewhere reaches it"),
    # kiln/data: the refusals a library caller (kiln.fit, or code of the user's) reaches, or a trained run
    "kiln/data/batches.py:BatchLoader.__init__": (
        ALL, "kiln.fit's train_data, a Dataset with batch_size < 1 or no rows (the `kiln` command reads data.source)"),
    "kiln/data/batches.py:BatchLoader._iterable_batch": (
        ALL, "kiln.fit's one-shot iterator that runs out (tests/run/test_fit.py checks the line)"),
    "kiln/data/batches.py:BatchLoader.load_state_dict": (
        ALL, "kiln.fit resumed with another seed, world size or a one-shot iterator (a run and a resume: kept out of "
             "this table's time)"),
    "kiln/data/documents.py:document_separator": (
        ALL, "DataConfig.validate refuses data.document_mask with data.format=tokens first (row above); a "
             "PreparedData built in code reaches it"),
    "kiln/data/loader.py:_check_length": (
        3, "chat windows packed for another seq_len, tokens not 1-D, seq_len < 1: the run builder passes what it "
           "prepared with data.seq_len (≥ 1 by DataConfig.validate); a library caller reaches them"),
    "kiln/data/loader.py:TokenLoader.__init__": (
        ALL, "train.micro_batch_size and data.prefetch are checked by their sections first; a library caller "
             "reaches it"),
    "kiln/data/loader.py:TokenLoader.load_state_dict": (
        ALL, "a resume with other data settings or world size (a run and a resume: kept out of this table's time)"),
    "kiln/data/loader.py:TokenLoader.skip": (
        ALL, "kiln skips forward only (numerics' rollback past a spike); a library caller reaches it"),
    "kiln/data/loader.py:val_batches": (
        ALL, "train.micro_batch_size is checked by TrainConfig first and the batch count is ≥ 1; a library caller "
             "reaches it (tests/data/test_data_loader.py)"),
    "kiln/data/mix.py:Mixture.check_length": (
        ALL, "prepare_data refuses a [[data.mix]] source shorter than data.seq_len + 1 first (kiln/data/prepared.py, "
             "a CorpusError); a library caller's Mixture reaches it"),
    "kiln/data/shards.py:ShardWriter.__init__": (
        ALL, "kiln writes shards with its tokenizer's dtype (dtype_for_vocab) and 16-digit fingerprint; a library "
             "caller of ShardWriter reaches it"),
    "kiln/data/shards.py:ShardWriter.append": (
        ALL, "the workers write ids of the tokenizer the shard's dtype was chosen for; a library caller reaches it"),
    "kiln/data/summary.py:unigram_entropy": (
        ALL, "ids are checked against the vocabulary where they are read (check_ids, data.format=tokens); a library "
             "caller reaches it"),
    "kiln/data/tokenizer.py:BPETokenizer.__init__": (
        ALL, "a run's tokenizer.json is kiln's own, with <|endoftext|>; a hand-replaced one is read after the run's "
             "checkpoint (a trained run: kept out of this table's time)"),
    "kiln/data/tokenizer.py:IdsTokenizer.encode": (
        ALL, "`kiln sample` of a run trained on data.format=tokens without hf:DIR (a trained run: kept out of this "
             "table's time)"),
    "kiln/data/tokenizer.py:load_tokenizer": (
        ALL, "a run's damaged tokenizer.json is read after its checkpoint (a trained run: kept out of this table's "
             "time); a shard cache's is rebuilt by prepare_data instead (tests/data/test_data_prepare.py)"),
    "kiln/train/optim.py:AdaptiveClip.load_state_dict": (
        ALL, "a resume with another optim.clip_history (a run and a resume: kept out of this table's time)"),
    "kiln/models/costs.py:part": (
        ALL, "model.mlp is checked by Family.check_parts first (rows above); a family registered with an unknown "
             "part kind fails at import (tests/models/test_families.py)"),
    "kiln/models/family.py:Family.hf_tensors": (
        ALL, "every registered family has a Hugging Face mapping; a family added without one reaches it"),
    "kiln/models/documents.py:check_doc": (
        ALL, "kiln's loader builds doc from the batch; a library caller's model(idx, doc=...) reaches it "
             "(tests/models/test_document_mask.py)"),
    "kiln/models/transformer.py:Transformer.hidden": (
        ALL, "data.seq_len > model.max_seq_len is refused by the config first (tests/test_config.py) and kiln sample "
             "crops prompts to the window; a library caller's longer batch, or doc with a KV cache, reaches it"),
    "kiln/models/parts.py:SDPA.forward": (
        ALL, "a BlockMask (flex attention) is built on CUDA only: model.dropout > 0 with a document mask on a GPU"),
    "kiln/models/generate.py:Sampling.__post_init__": (
        ALL, "`kiln sample` checks --temperature, --top-k and --top-p first (ConfigError); a library caller reaches it"),
    "kiln/models/generate.py:generate": (
        ALL, "`kiln sample`'s prompts hold at least the start token; a library caller's empty prompt reaches it"),
    "kiln/models/lora.py:LoraLinear.__init__": (
        ALL, "kiln derives the pieces from the family's fused linears; a library caller's LoraLinear reaches it"),
    "kiln/kernels/apply.py:apply_kernels": (
        ALL, "train.kernels=triton on a CPU is refused first (resolve_kernels, row above); on CUDA, model.dropout > 0 "
             "reaches it (tests/kernels/test_kernels_apply.py)"),
    "kiln/kernels/flash_attention.py:FlashAttention.forward": (
        ALL, "apply_kernels refuses dropout before any forward; a library caller's FlashAttention(dropout=...) "
             "reaches it"),
    "kiln/kernels/utils.py:row_tile": (
        ALL, "train.kernels=triton (CUDA) with rows wider than 65536 (model.d_model): not this machine"),
    **{f"kiln/kernels/{site}": (ALL, "a library call of a kiln.kernels op with arguments of the wrong shape, stride "
                                     "or value; kiln's own modules pass what the op takes")
       for site in ["cross_entropy.py:_check", "cross_entropy.py:cross_entropy_rows", "flash_attention.py:_check",
                    "fused_linear_cross_entropy.py:fused_linear_cross_entropy_forward", "rope.py:_check",
                    "swiglu.py:swiglu_forward", "layer_norm.py:LayerNorm.from_torch"]},
    "kiln/numerics/faults.py:FaultInjector.__init__": (
        1, "faults.spike or faults.unshifted_labels for a model that does not train on token ids: kiln.fit only"),
    "kiln/numerics/monitor.py:Numerics.__init__": (
        ALL, "faults with train.compile=true: kiln/config.py's cross-check names it first; kiln.fit reaches it"),
    "kiln/perf/estimate.py:training_estimate": (
        1, "--gpus below 1 is refused by `kiln estimate` itself first; a library caller reaches it"),
    **{site: (ALL, "kiln.fit of a model of the user's under torchrun with parallel.tp, parallel.ep or "
                   "tensor_parallel= (a launch: kept out of this table's time; tests/parallel/"
                   "test_fit_tensor_parallel.py checks the lines)")
       for site in ["kiln/parallel/tensor.py:apply_tensor_parallel", "kiln/parallel/expert.py:shard_experts",
                    "kiln/parallel/user_plan.py:apply_user_plan", "kiln/parallel/user_plan.py:_hold"]},
    "kiln/parallel/world.py:init_world": (
        2, "under torchrun only: an environment without torchrun's variables, or parallel.strategy=none over more "
           "processes than tp × pp (a launch: kept out of this table's time)"),
    "kiln/parallel/context.py:_shard_inputs.hook": (
        ALL, "generation with a KV cache on a context-parallel model: a library caller (kiln sample builds a plain one)"),
    "kiln/parallel/pipeline.py:PipelineModel.forward": (
        ALL, "a library caller's forward of a pipeline-parallel model (kiln runs it through its schedule)"),
    "kiln/evaluate/loglik.py:rolling_windows": (
        ALL, "the window is model.max_seq_len, ≥ 1 once the config resolves; a library caller reaches it"),
    "kiln/evaluate/loglik.py:_row": (
        ALL, "`kiln eval` of a task whose answers are longer than a trained checkpoint's window (a checkpoint: "
             "kept out of this table's time)"),
    # kiln/train and kiln/run (#37, second pass): reached by a resume, a GPU, torchrun, or kiln.fit / a library call
    **{site: (ALL, "a resume of a run written otherwise (a run and a resume: kept out of this table's time; "
                   "tests/train/test_reliability.py, tests/parallel/ check the lines)")
       for site in ["kiln/train/loop.py:Trainer.resume", "kiln/train/state.py:TrainState.load_state_dict",
                    "kiln/train/checkpoint.py:Checkpointer.load_sharded", "kiln/train/checkpoint.py:_by_name",
                    "kiln/train/checkpoint.py:Checkpointer._load_whole", "kiln/train/checkpoint.py:refuse_per_expert",
                    "kiln/run/adapters.py:to_hub"]},
    "kiln/train/precision.py:convert_fp8": (
        ALL, "precision.mode=fp8 builds on CUDA only (without torchao, or with no linear of dimensions multiple of 16)"),
    "kiln/train/pipeline.py:prepare_model": (
        2, "the fused/chunked loss on a model without an LMLoss (kiln.fit refuses memory.chunked_loss first), and "
           "train.compile with parallel.pp (under torchrun)"),
    "kiln/train/pipeline.py:_needs_blocks": (
        ALL, "kiln.fit refuses memory.recompute / offload_blocks on a model without blocks first (kiln/run/fit.py); "
             "a library caller of prepare_model reaches it"),
    "kiln/run/builder.py:accumulation_for": (
        ALL, "under torchrun only: train.global_batch_size not a multiple of micro_batch_size × world size "
             "(TrainConfig refuses one process's case first, row above)"),
    "kiln/run/lm.py:LMParts.model": (
        ALL, "model.init=hf:DIR whose weights do not fill kiln's model (a checkpoint: kept out of this table's time)"),
    "kiln/run/sample.py:encode_prompt": (
        ALL, "`kiln sample` of a trained run or hf:DIR without a chat template, on chat prompts (a checkpoint: kept "
             "out of this table's time)"),
    "kiln/run/profile.py:profile_run": (
        ALL, "`kiln profile` refuses --steps < 1 and --warmup < 0 itself first (ConfigError); a library caller "
             "reaches it"),
    **{site: (n, "kiln.fit / kiln.predict only: the `fit(...)` or `predict(...)` arguments of a model of the "
                 "user's (tests/run/test_fit.py); the FitInputErrors beside them count in ALLOWED_FILES")
       for site, n in [("kiln/run/fit.py:_check_layout", 1), ("kiln/run/fit.py:_plan", 5),
                       ("kiln/run/predict.py:_batches", 1), ("kiln/run/predict.py:predict", 2),
                       ("kiln/train/objective.py:_pair", 1), ("kiln/train/optim.py:build_optimizer", 1),
                       ("kiln/train/losses.py:as_loss", 1), ("kiln/train/losses.py:_per_sample_sum", 1),
                       ("kiln/train/losses.py:CrossEntropy.__call__", 1), ("kiln/train/losses.py:NTXent.__call__", 1)]},
    **{site: (ALL, "a library caller's constructor arguments (kiln builds these from sections validated first: "
                   "OptimConfig, the loss names)")
       for site in ["kiln/train/losses.py:CrossEntropy.__init__", "kiln/train/losses.py:Huber.__init__",
                    "kiln/train/losses.py:NTXent.__init__", "kiln/train/masked.py:MaskedAdam.__init__",
                    "kiln/train/masked.py:MaskedSGD.__init__", "kiln/train/adam8bit.py:AdamW8bit.__init__",
                    "kiln/train/host_optimizer.py:HostOptimizer.step"]},
}
# Files whose errors were typed (ConfigError, SourceError, ...) before KilnError existed, with how many raises
# each held then: their refusals are tested message by message by the files named. A raise added to one of them
# beyond that count needs a row above (or the count raised here, with the test that covers it).
ALLOWED_FILES = {
    "kiln/config.py": (19, "ConfigError: tests/test_config.py, tests/cli/test_bad_input.py, tests/train/test_muon.py, "
                           "tests/data/test_data_documents.py"),
    **{f"kiln/cli/{name}.py": (n, "the command's own flags and files: tests/cli/test_bad_input.py, tests/cli/")
       for name, n in [("checkpoints", 1), ("common", 1), ("data", 1), ("estimate", 4), ("eval", 4), ("export", 6),
                       ("memory", 1), ("plan", 3), ("profile", 2), ("report", 1), ("sample", 6), ("train", 6)]},
    "kiln/data/cache.py": (4, "ShardError of a damaged cache, which prepare_data rebuilds: tests/data/"),
    "kiln/data/build.py": (3, "CorpusError of a corpus that cannot be split or tokens with bpe: tests/data/"),
    "kiln/data/prepared.py": (2, "CorpusError of a [[data.mix]]'s sources: tests/data/"),
    "kiln/data/chat_data.py": (7, "CorpusError of a chat source (file:line): tests/data/test_sft.py"),
    "kiln/data/sft.py": (11, "ChatRecordError of a record (file:line), the template's prefixes, data.document_mask "
                             "(a bool from the CLI): tests/data/test_sft.py"),
    "kiln/data/corpus.py": (4, "CorpusError: tests/data/test_data_corpus.py, tests/data/test_data_stream.py"),
    "kiln/data/prepare.py": (10, "CorpusError, ShardError: tests/data/test_data_prepare.py"),
    "kiln/data/pretokenized.py": (7, "ShardError: tests/data/"),
    "kiln/data/shards.py": (8, "ShardError: tests/data/test_data_shards.py, tests/data/test_data_prepare.py"),
    "kiln/evaluate/tasks.py": (17, "TaskError: tests/evaluate/test_tasks_and_metrics.py"),
    "kiln/evaluate/score.py": (1, "TaskError: tests/evaluate/"),
    "kiln/run/fit.py": (8, "FitInputError: tests/run/test_fit.py, tests/parallel/test_fit_tensor_parallel.py"),
    "kiln/run/fit_checks.py": (14, "FitInputError: tests/run/test_fit.py"),
    "kiln/run/predict.py": (7, "MetricError: tests/run/test_fit.py (metrics=)"),
    "kiln/run/source.py": (9, "SourceError: tests/run/test_source.py, tests/run/test_lora_checkpoints.py"),
    "kiln/interop/peft.py": (13, "PeftError: tests/interop/test_peft.py (every read_peft and merged refusal, word for "
                                 "word), tests/run/test_lora_checkpoints.py (lora.init through `kiln train`)"),
    "kiln/interop/base.py": (3, "BaseChanged: tests/interop/test_peft.py, tests/run/test_lora_checkpoints.py (resume, "
                                "sample)"),
    "kiln/train/checkpoint.py": (9, "CheckpointCorrupt: tests/train/test_reliability.py, test_damaged_files.py"),
}


def _family(trees: list[ast.Module]) -> set[str]:
    """KilnError and every class in kiln that derives from it, by name (bases read from the source)."""
    bases: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1] for b in node.bases)
    family = {"KilnError"}
    while True:
        more = {name for name, b in bases.items() if b & family} - family
        if not more:
            return family
        family |= more


def raise_sites(root: Path = KILN) -> dict[str, int]:
    """{"kiln/x.py:Class.function": how many KilnError raises it holds}."""
    files = sorted(root.rglob("*.py"))
    trees = [ast.parse(path.read_text()) for path in files]
    family = _family(trees)
    sites: dict[str, int] = {}

    def visit(node, path, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, path, scope + [child.name])
                continue
            if isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call):
                name = ast.unparse(child.exc.func).split(".")[-1]
                if name in family:
                    site = f"{path}:{'.'.join(scope) or '<module>'}"
                    sites[site] = sites.get(site, 0) + 1
            visit(child, path, scope)

    for path, tree in zip(files, trees):
        visit(tree, path.relative_to(root.parent).as_posix(), [])
    return sites


def test_every_raise_site_is_in_the_table():
    sites = raise_sites()
    rows: dict[str, int] = {}
    for site, _, _ in SITES:
        rows[site] = rows.get(site, 0) + 1
    unlisted: dict[str, list[str]] = {}  # file -> its sites' raises without a row, one entry per raise
    for site, n in sorted(sites.items()):
        left = n - rows.get(site, 0) - ALLOWED.get(site, (0, ""))[0]
        unlisted.setdefault(site.split(":")[0], []).extend([site] * max(0, left))
    missing = []
    for path, left in unlisted.items():
        allowed = ALLOWED_FILES.get(path, (0, ""))[0]
        if len(left) > allowed:
            missing += [f"{site}: {sites[site]} raise(s), {rows.get(site, 0)} row(s) in SITES" for site in sorted(set(left))]
            if allowed:
                missing.append(f"  ({path} may hold {allowed} raises without rows, ALLOWED_FILES; it holds {len(left)})")
    stale = [f"{site}: in the table, but it raises no KilnError" for site in sorted({*rows, *ALLOWED}) if site not in sites]
    stale += [f"{path}: in ALLOWED_FILES, but it raises no KilnError" for path in ALLOWED_FILES
              if not any(site.startswith(path + ":") for site in sites)]
    assert not missing and not stale, "\n".join(
        ["each `raise KilnError(...)` (or a subclass) needs a row in SITES (a bad input that reaches it) or an "
         "entry in ALLOWED with the reason:", *missing, *stale])
    assert len(sites) > 50, sites  # the scan finds the sites that exist (it is not looking at nothing)


def _innermost(e: BaseException) -> BaseException:
    """The deepest KilnError in the chain: a section's error re-raised as a ConfigError is where it came from."""
    while isinstance(e.__cause__, KilnError):
        e = e.__cause__
    return e


def _site_of(e: BaseException) -> str:
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename).resolve().relative_to(ROOT).as_posix()
    return f"{path}:{tb.tb_frame.f_code.co_qualname}"


@pytest.mark.parametrize("site, argv, fragments", SITES, ids=[
    f"{s[0].split(':')[0][5:]}:{' '.join(s[1][3:] if s[1][0] in ('memory', 'train') else s[1])}" for s in SITES])
def test_site_is_one_line(site, argv, fragments, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in ("KILN_TRACEBACK", "KILN_DEBUG", "TRITON_INTERPRET"):  # (tests/kernels sets the interpreter)
        monkeypatch.delenv(name, raising=False)
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(text):
            if any(a.endswith(name) for a in argv):  # (only the row that names it pays for it)
                text(path)
        elif isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    status = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2, f"exit status {status}\nstdout: {out}\nstderr: {err}"
    assert len(lines) == 1 and lines[0].startswith(f"kiln {argv[0]}: error: "), err
    assert "Traceback" not in out + err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in: {lines[0]}"

    with pytest.raises(KilnError) as info:
        main(["--traceback", *argv])
    deep = _innermost(info.value)
    assert _site_of(deep) == site, f"the row reaches {_site_of(deep)}, not {site}: {deep}"
    assert deep.key and deep.key.split("=")[0] in lines[0], f"key {deep.key!r} is not named in: {lines[0]}"
