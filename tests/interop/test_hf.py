"""Hugging Face in and out: small random GPT-2, Llama, Qwen3 and Qwen3-MoE models built by transformers from
configs (nothing is downloaded), imported into kiln and exported back, their logits compared with transformers'
own."""
import json

import pytest
import torch

from kiln.interop.hf import read_hf, write_hf
from kiln.models import build_model
from kiln.models.generate import generate

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")

GPT2 = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=301, layer_norm_epsilon=1e-5,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LLAMA = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=96,
             max_position_embeddings=64, vocab_size=300, rms_norm_eps=1e-6, rope_theta=5000.0,
             tie_word_embeddings=False)
# a head width of its own (24, not 64 / 4), as Qwen3's 128 is not hidden_size / heads
QWEN3 = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, hidden_size=64,
             intermediate_size=96, max_position_embeddings=64, vocab_size=300, rms_norm_eps=1e-6, rope_theta=5000.0,
             tie_word_embeddings=True)
QWEN3_MOE = QWEN3 | dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                         tie_word_embeddings=False)
KINDS = {"gpt2": ("GPT2LMHeadModel", "GPT2Config", GPT2), "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA),
         "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", QWEN3),
         "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE)}


def _hf_model(kind: str, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    model_cls, config_cls, base = KINDS[kind]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**(base | overrides)))
    _eager_experts(model)
    with torch.no_grad():  # transformers zero-inits some biases and norms: random values test the mapping
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(dtype).eval()


def _eager_experts(model):
    """transformers 5 runs experts through torch._grouped_mm, which has no fp64: the per-expert loop instead."""
    if hasattr(model, "set_experts_implementation") and model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    return model


def _kiln(directory, dtype=torch.float32):
    cfg, state = read_hf(directory)
    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("rope_") for k in missing), (missing, unexpected)
    return cfg, model.to(dtype).eval()


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # 16 < the test's 32 positions
CASES = [("gpt2", {}), ("gpt2", {"tie_word_embeddings": False}), ("gpt2", {"activation_function": "relu2"}),
         ("gpt2", {"activation_function": "gelu"}),
         ("llama", {}),
         ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}), ("llama", {"rope_parameters": LLAMA3}),
         ("qwen3", {}), ("qwen3", {"tie_word_embeddings": False}), ("qwen3_moe", {}),
         ("qwen3_moe", {"norm_topk_prob": False, "tie_word_embeddings": True})]


@pytest.mark.parametrize("kind, overrides", CASES,
                         ids=["gpt2", "gpt2-untied", "gpt2-relu2", "gpt2-gelu-erf", "llama-gqa-untied", "llama-mha-tied", "llama3-rope-scaling", "qwen3-tied", "qwen3-untied",
                              "qwen3-moe-normalised", "qwen3-moe-raw-topk-tied"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_import_then_export_gives_transformers_logits(kind, overrides, dtype, tol, tmp_path):
    if kind != "gpt2" and dtype == torch.float64:
        tol = 3e-7  # kiln's RoPE cos/sin tables are computed and kept in fp32 (transformers computes them in fp64)
    hf = _hf_model(kind, dtype, **overrides)
    hf.save_pretrained(tmp_path / "hf")
    cfg, model = _kiln(tmp_path / "hf", dtype)
    ids = torch.randint(0, hf.config.vocab_size, (2, 32))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)[..., :hf.config.vocab_size]
    assert (got - want).abs().max().item() <= tol
    # and back: transformers loads kiln's export with nothing missing or unexpected
    write_hf(cfg, model.state_dict(), hf.config.vocab_size, tmp_path / "out")
    cls = type(hf)
    back, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True, torch_dtype=dtype)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert (_eager_experts(back).eval()(ids).logits - want).abs().max().item() <= tol


def test_sharded_export_loads_and_greedy_generation_matches(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    cfg, model = _kiln(tmp_path / "hf")
    files = write_hf(cfg, model.state_dict(), hf.config.vocab_size, tmp_path / "out", max_shard_bytes=100_000)
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    prompt = torch.randint(0, hf.config.vocab_size, (1, 5))
    ours = generate(model, prompt.tolist(), 32, vocab_limit=hf.config.vocab_size)
    theirs = back.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert ours.tokens == theirs[:, 5:].tolist()


def test_bad_checkpoints_are_clear_errors(tmp_path):
    hf = _hf_model("gpt2")
    hf.save_pretrained(tmp_path / "hf")
    cfg_path, weights = tmp_path / "hf" / "config.json", tmp_path / "hf" / "model.safetensors"
    good_cfg, good_weights = cfg_path.read_text(), weights.read_bytes()

    weights.write_bytes(good_weights[: len(good_weights) // 2])
    with pytest.raises(ValueError, match="damaged or truncated"):
        read_hf(tmp_path / "hf")
    weights.write_bytes(good_weights)
    cfg_path.write_text(json.dumps(json.loads(good_cfg) | {"model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type='mamba' is not one kiln reads"):
        read_hf(tmp_path / "hf")
    cfg_path.write_text(json.dumps(json.loads(good_cfg) | {"n_embd": 96}))
    with pytest.raises(ValueError, match="has shape .* config.json implies"):
        read_hf(tmp_path / "hf")
    llama = _hf_model("llama")
    llama.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 16}
    llama.save_pretrained(tmp_path / "yarn")
    with pytest.raises(ValueError, match="rope_scaling of type 'yarn' is not one kiln's RoPE has"):
        read_hf(tmp_path / "yarn")
    weights.unlink()
    cfg_path.write_text(good_cfg)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        read_hf(tmp_path / "hf")


@pytest.fixture
def hf_dir(tmp_path, corpus_file):
    """A random 2-layer GPT-2 with a 301-token BPE tokenizer of its own, saved as transformers saves them."""
    from kiln.data.tokenizer import BPETokenizer

    directory = tmp_path / "hf-gpt2"
    _hf_model("gpt2").save_pretrained(directory)
    BPETokenizer.train([corpus_file.read_text()], 301).save(directory)
    return directory


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_fine_tune_from_hf_resumes_bit_identically_and_exports_back(hf_dir, small_config, tmp_path, capsys):
    from kiln.cli.main import main
    from kiln.run.lm import train

    def cfg(steps, **kw):
        c = small_config(train={"max_steps": steps}, schedule={"total_steps": 8}, **kw)
        c.model.init = f"hf:{hf_dir}"
        return c

    straight = train(cfg(8), tmp_path / "straight")
    assert straight.state.model.cfg.d_model == 64 and straight.state.model.cfg.vocab_size == 301
    assert (tmp_path / "straight" / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    train(cfg(4, checkpoint={"interval": 4}), tmp_path / "resumed")
    train(cfg(8), tmp_path / "resumed", resume=True)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    # the fine-tuned model, exported and loaded by transformers, gives kiln's logits
    assert main(["export", str(tmp_path / "straight"), "--hf", str(tmp_path / "export")]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    model = straight.state.model.eval()
    ids = torch.randint(0, 301, (1, 16))
    with torch.no_grad():
        assert (back(ids).logits - model(ids)[..., :301]).abs().max().item() <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"


def test_an_imported_tokenizer_larger_than_the_model_is_refused(hf_dir, small_config, tmp_path):
    from kiln.data.tokenizer import BPETokenizer
    from kiln.run.lm import train

    BPETokenizer.train([(hf_dir / "config.json").read_text() * 50 + "abcdefghij" * 99], 400).save(hf_dir)
    c = small_config(train={"max_steps": 1})
    c.model.init = f"hf:{hf_dir}"
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        train(c, tmp_path / "run")


def test_a_run_trained_from_scratch_exports_and_loads_without_warnings(small_config, tmp_path, capfd):
    """kiln's own bias-free GPT-2 (the default job's kind) is GPT-2 with every bias zero: it exports, and
    transformers loads it without a warning about missing or newly initialised weights, giving kiln's logits."""
    from kiln.cli.main import main
    from kiln.run.lm import train

    result = train(small_config(train={"max_steps": 3}), tmp_path / "run")
    assert not result.state.model.cfg.bias
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 0
    transformers.logging.set_verbosity_warning()
    capfd.readouterr()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    err = capfd.readouterr().err
    assert "newly initialized" not in err and "not used" not in err and "missing" not in err.lower(), err
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert (back(ids).logits - result.state.model.eval()(ids)[..., :256]).abs().max().item() <= 1e-5


def test_a_bad_hf_directory_is_one_line_at_the_command_line(tmp_path, capsys):
    from kiln.cli.main import main

    _hf_model("gpt2").save_pretrained(tmp_path / "hf")
    config = tmp_path / "hf" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model_type": "mamba"}))
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["train", f"--model.init=hf:{tmp_path / 'hf'}", "--train.max_steps=1", "--train.device=cpu",
                 f"--run-dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type='mamba' is not one kiln reads" in err[0]
