"""Hugging Face checkpoints in and out: GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM, with Llama 3's RoPE scaling).

    model_cfg, state = read_hf(DIR)           config.json + model.safetensors (or its shards) -> kiln's shape and
                                              state dict (kiln's names, vocabulary padded to kiln's multiple of 64)
    write_hf(model_cfg, state, vocab, OUT)    the reverse: config.json, model.safetensors (sharded above a size),
                                              generation_config.json, loadable by transformers' from_pretrained

It is a mapping, not a rename: kiln fuses q/k/v into attn.qkv and Llama's gate and up into mlp.fc, GPT-2's
Conv1D stores its matrices as (in, out) where kiln's Linear stores (out, in), and kiln pads the vocabulary. Only
safetensors and json are read and written: transformers is not needed, and nothing is ever downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.models import ModelConfig

INDEX = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a Hugging Face model directory holds config.json and "
                                f"model.safetensors (save it with save_pretrained)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg})") from None


def kiln_config(hf: dict, source: str = "config.json") -> ModelConfig:
    """kiln's ModelConfig for a Hugging Face config.json (every shape field set: no preset fills anything)."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{source}: activation_function={hf['activation_function']!r}; kiln's GPT-2 uses the "
                             f"tanh GELU (gelu_new)")
        d = hf["n_embd"]
        return ModelConfig(preset="gpt2-124m", arch="gpt2", n_layer=hf["n_layer"], n_head=hf["n_head"],
                           n_kv_head=hf["n_head"], d_model=d, d_ff=hf.get("n_inner") or 4 * d,
                           vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"], bias=True,
                           tie_embeddings=hf.get("tie_word_embeddings", True),
                           norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    if kind == "llama":
        d, H = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("head_dim", d // H) != d // H:
            raise ValueError(f"{source}: head_dim={hf['head_dim']} is not hidden_size / num_attention_heads; kiln's "
                             f"attention derives it from the width")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError(f"{source}: biases in Llama's attention or MLP are not in kiln's Llama block")
        # transformers 5 keeps RoPE's settings in rope_parameters; earlier versions in rope_theta and rope_scaling
        rope = hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or rope
        kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
        if kind not in (None, "default", "llama3"):
            raise ValueError(f"{source}: rope_scaling of type {kind!r} is not one kiln's RoPE has (it has plain "
                             f"rope_theta and Llama 3's 'llama3')")
        llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
                  float(scaling["original_max_position_embeddings"])) if kind == "llama3" else ()
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r}; kiln's Llama MLP is SwiGLU (silu)")
        return ModelConfig(preset="llama-125m", arch="llama", n_layer=hf["num_hidden_layers"], n_head=H,
                           n_kv_head=hf.get("num_key_value_heads") or H, d_model=d, d_ff=hf["intermediate_size"],
                           vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"], bias=False,
                           tie_embeddings=hf.get("tie_word_embeddings", False), norm_eps=hf.get("rms_norm_eps", 1e-6),
                           rope_theta=float(theta), rope_scaling=llama3)
    raise ValueError(f"{source}: model_type={kind!r} is not one kiln reads; it reads 'gpt2' (GPT2LMHeadModel) and "
                     f"'llama' (LlamaForCausalLM)")


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
            raise ValueError(f"{f} does not load as safetensors ({e}); the file is damaged or truncated: copy it "
                             f"again") from None
    return tensors


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _take(tensors: dict, name: str, shape: tuple, source: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{source}: no tensor {name!r}; the checkpoint does not match its config.json")
    t = tensors.pop(name)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}")
    return t


def read_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """kiln's model config and state dict from a Hugging Face model directory."""
    directory = Path(directory)
    hf = _read_json(directory / "config.json")
    cfg = kiln_config(hf, str(directory / "config.json"))
    tensors = _read_tensors(directory)
    src = str(directory)
    V, Vp, d, L = cfg.vocab_size, cfg.padded_vocab, cfg.d_model, cfg.n_layer
    out: dict[str, torch.Tensor] = {}
    if cfg.arch == "gpt2":
        p = "transformer." if "transformer.wte.weight" in tensors else ""
        out["embed.weight"] = _pad_rows(_take(tensors, f"{p}wte.weight", (V, d), src), Vp)
        out["pos_embed.weight"] = _take(tensors, f"{p}wpe.weight", (cfg.max_seq_len, d), src)
        for i in range(L):
            h, b = f"{p}h.{i}.", f"blocks.{i}."
            for hf_name, name, shape in (("ln_1", "norm1", None), ("ln_2", "norm2", None),
                                         ("attn.c_attn", "attn.qkv", (d, 3 * d)), ("attn.c_proj", "attn.proj", (d, d)),
                                         ("mlp.c_fc", "mlp.fc", (d, cfg.d_ff)), ("mlp.c_proj", "mlp.proj", (cfg.d_ff, d))):
                if shape is None:  # LayerNorm
                    out[f"{b}{name}.weight"] = _take(tensors, f"{h}{hf_name}.weight", (d,), src)
                    out[f"{b}{name}.bias"] = _take(tensors, f"{h}{hf_name}.bias", (d,), src)
                else:  # Conv1D: (in, out) -> Linear's (out, in)
                    out[f"{b}{name}.weight"] = _take(tensors, f"{h}{hf_name}.weight", shape, src).t().contiguous()
                    out[f"{b}{name}.bias"] = _take(tensors, f"{h}{hf_name}.bias", (shape[1],), src)
        out["norm.weight"] = _take(tensors, f"{p}ln_f.weight", (d,), src)
        out["norm.bias"] = _take(tensors, f"{p}ln_f.bias", (d,), src)
        if not cfg.tie_embeddings:
            out["head.weight"] = _pad_rows(_take(tensors, "lm_head.weight", (V, d), src), Vp)
    else:
        H, KV, hd, F = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
        out["embed.weight"] = _pad_rows(_take(tensors, "model.embed_tokens.weight", (V, d), src), Vp)
        for i in range(L):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            out[f"{b}norm1.weight"] = _take(tensors, f"{h}input_layernorm.weight", (d,), src)
            out[f"{b}norm2.weight"] = _take(tensors, f"{h}post_attention_layernorm.weight", (d,), src)
            out[f"{b}attn.qkv.weight"] = torch.cat([
                _take(tensors, f"{h}self_attn.q_proj.weight", (H * hd, d), src),
                _take(tensors, f"{h}self_attn.k_proj.weight", (KV * hd, d), src),
                _take(tensors, f"{h}self_attn.v_proj.weight", (KV * hd, d), src)])
            out[f"{b}attn.proj.weight"] = _take(tensors, f"{h}self_attn.o_proj.weight", (d, H * hd), src)
            out[f"{b}mlp.fc.weight"] = torch.cat([_take(tensors, f"{h}mlp.gate_proj.weight", (F, d), src),
                                                  _take(tensors, f"{h}mlp.up_proj.weight", (F, d), src)])
            out[f"{b}mlp.proj.weight"] = _take(tensors, f"{h}mlp.down_proj.weight", (d, F), src)
        out["norm.weight"] = _take(tensors, "model.norm.weight", (d,), src)
        if not cfg.tie_embeddings:
            out["head.weight"] = _pad_rows(_take(tensors, "lm_head.weight", (V, d), src), Vp)
    tensors.pop("lm_head.weight", None)  # a tied head saved anyway
    left = [k for k in tensors if not k.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))]
    if left:
        raise ValueError(f"{src}: tensors kiln has no place for: {', '.join(sorted(left)[:5])}"
                         + (" ..." if len(left) > 5 else ""))
    return cfg, out


def hf_config(cfg: ModelConfig, vocab: int, eos: int | None = None) -> dict:
    """The config.json of kiln's model for transformers (vocabulary without kiln's padding)."""
    if cfg.arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.n_layer,
                "n_head": cfg.n_head, "n_embd": cfg.d_model, "n_inner": cfg.d_ff, "n_positions": cfg.max_seq_len,
                "n_ctx": cfg.max_seq_len, "vocab_size": vocab, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "tie_word_embeddings": bool(cfg.tie_embeddings),
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": "float32",
                "bos_token_id": eos, "eos_token_id": eos}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "max_position_embeddings": cfg.max_seq_len, "vocab_size": vocab,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
            "rope_parameters": _rope_parameters(cfg),
            "rope_scaling": _rope_parameters(cfg) if cfg.rope_scaling else None,
            "tie_word_embeddings": bool(cfg.tie_embeddings), "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "float32", "bos_token_id": eos, "eos_token_id": eos}


def _bias(state: dict, module: str) -> torch.Tensor:
    """A module's bias; zeros for kiln's bias-free GPT-2 (model.bias=false), which is GPT-2 with every bias 0."""
    if f"{module}.bias" in state:
        return state[f"{module}.bias"]
    weight = state[f"{module}.weight"]
    return weight.new_zeros(weight.shape[0])


def _rope_parameters(cfg: ModelConfig) -> dict:
    if not cfg.rope_scaling:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    factor, low, high, original = cfg.rope_scaling
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(original)}


def hf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """kiln's state dict under transformers' names and layouts, the vocabulary padding removed."""
    s = {k.removeprefix("_orig_mod."): v.detach().float().cpu() for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    if cfg.arch == "gpt2":
        out["transformer.wte.weight"] = s["embed.weight"][:vocab]
        out["transformer.wpe.weight"] = s["pos_embed.weight"]
        for i in range(cfg.n_layer):
            h, b = f"transformer.h.{i}.", f"blocks.{i}."
            for hf_name, name in (("ln_1", "norm1"), ("ln_2", "norm2")):
                out[f"{h}{hf_name}.weight"] = s[f"{b}{name}.weight"]
            for hf_name, name in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"), ("mlp.c_fc", "mlp.fc"),
                                  ("mlp.c_proj", "mlp.proj")):
                out[f"{h}{hf_name}.weight"] = s[f"{b}{name}.weight"].t()
                out[f"{h}{hf_name}.bias"] = _bias(s, f"{b}{name}")
            for hf_name, name in (("ln_1", "norm1"), ("ln_2", "norm2")):
                out[f"{h}{hf_name}.bias"] = _bias(s, f"{b}{name}")
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = s["norm.weight"], _bias(s, "norm")
        out["lm_head.weight"] = s["head.weight"][:vocab] if "head.weight" in s else out["transformer.wte.weight"]
    else:
        H, KV, hd, F = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
        out["model.embed_tokens.weight"] = s["embed.weight"][:vocab]
        for i in range(cfg.n_layer):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            out[f"{h}input_layernorm.weight"] = s[f"{b}norm1.weight"]
            out[f"{h}post_attention_layernorm.weight"] = s[f"{b}norm2.weight"]
            q, k, v = s[f"{b}attn.qkv.weight"].split([H * hd, KV * hd, KV * hd])
            out[f"{h}self_attn.q_proj.weight"], out[f"{h}self_attn.k_proj.weight"] = q, k
            out[f"{h}self_attn.v_proj.weight"] = v
            out[f"{h}self_attn.o_proj.weight"] = s[f"{b}attn.proj.weight"]
            gate, up = s[f"{b}mlp.fc.weight"].split([F, F])
            out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
            out[f"{h}mlp.down_proj.weight"] = s[f"{b}mlp.proj.weight"]
        out["model.norm.weight"] = s["norm.weight"]
        out["lm_head.weight"] = (s["head.weight"] if "head.weight" in s else s["embed.weight"])[:vocab]
    if cfg.tie_embeddings:
        out.pop("lm_head.weight")  # transformers ties it to the embedding itself
    return {k: v.contiguous() for k, v in out.items()}


def write_hf(cfg: ModelConfig, state: dict[str, torch.Tensor], vocab: int, out_dir: str | Path,
             max_shard_bytes: int = 5 * 2**30, eos: int | None = None) -> list[Path]:
    """config.json, generation_config.json and model.safetensors (or shards and their index) in out_dir."""
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
