import pytest
import torch

from kiln.models import ModelConfig


def gpt2_cfg(**kw) -> ModelConfig:
    """2 blocks, width 64, 4 heads: shapes chosen so no activation shares a shape with a weight."""
    base = dict(preset="gpt2-124m", n_layer=2, n_head=4, d_model=64, max_seq_len=64, vocab_size=200)
    return ModelConfig(**(base | kw)).resolve()


def llama_cfg(**kw) -> ModelConfig:
    """2 blocks, width 64, 4 query heads sharing 2 key/value heads (GQA), SwiGLU width 160."""
    base = dict(preset="llama-125m", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160, max_seq_len=64,
                vocab_size=200)
    return ModelConfig(**(base | kw)).resolve()


def qwen3_cfg(**kw) -> ModelConfig:
    """Llama's test shape with QK-norm and a head width of its own (24, not 64 / 4)."""
    base = dict(preset="qwen3-0.6b", n_layer=2, n_head=4, n_kv_head=2, head_dim=24, d_model=64, d_ff=160,
                max_seq_len=64, vocab_size=200)
    return ModelConfig(**(base | kw)).resolve()


def qwen3_moe_cfg(**kw) -> ModelConfig:
    """qwen3_cfg's attention with 4 experts of width 48, 2 per token."""
    base = dict(preset="qwen3-moe-nano", n_layer=2, n_head=4, n_kv_head=2, head_dim=24, d_model=64, max_seq_len=64,
                vocab_size=200, n_experts=4, n_experts_active=2, moe_d_ff=48)
    return ModelConfig(**(base | kw)).resolve()


MODELS = {"gpt2": gpt2_cfg, "llama": llama_cfg, "qwen3": qwen3_cfg, "qwen3_moe": qwen3_moe_cfg}


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    """Seeded, and one intra-op thread: on a shared 2-core machine two OpenMP threads per process spin against
    other processes and small ops slow down 10-50x; the numbers these tests check do not depend on threads."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
