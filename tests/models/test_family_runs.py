"""The new families through kiln's whole path: `kiln train` logs the MoE's routing, `kiln.run.sample.load_model`
returns a model whose model(ids) is logits, and a Qwen3 saved by transformers fine-tunes through model.init."""
import json

import pytest
import torch

from kiln.run.lm import train
from kiln.run.sample import load_model


def _records(run_dir, kind="train"):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_a_mixture_of_experts_trains_logs_its_routing_and_loads_for_sampling(small_config, tmp_path):
    cfg = small_config(train={"max_steps": 3})
    cfg.model.arch, cfg.model.n_experts, cfg.model.n_experts_active, cfg.model.moe_d_ff = "qwen3_moe", 4, 2, 32
    result = train(cfg, tmp_path / "run")
    records = _records(tmp_path / "run")
    assert len(records) == 3
    for r in records:
        assert 0 < r["moe_aux_loss"] and r["moe_load_min"] <= 1 / 4 <= r["moe_load_max"] <= 1
    model, tokenizer, device = load_model(tmp_path / "run", device="cpu")
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        logits = model(ids)
        torch.testing.assert_close(logits, result.state.model.eval()(ids))
    assert logits.shape[:2] == (1, 8) and device.type == "cpu"


def test_qwen3_saved_by_transformers_fine_tunes_through_model_init(small_config, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=48,
        intermediate_size=96, max_position_embeddings=64, vocab_size=256, tie_word_embeddings=True,
        rope_theta=123456.0))
    hf.save_pretrained(tmp_path / "hf")
    cfg = small_config(train={"max_steps": 2})
    cfg.model.init = f"hf:{tmp_path / 'hf'}"
    result = train(cfg, tmp_path / "run")
    model = result.state.model
    assert model.cfg.arch == "qwen3" and model.cfg.head_dim == 16 and model.cfg.rope_theta == 123456.0
    losses = [r["loss"] for r in _records(tmp_path / "run")]
    assert len(losses) == 2 and all(l > 0 for l in losses)
