"""The attention core's stated costs (kiln/models/attention_costs.py) against what torch runs for kiln's SDPA core on
this CPU: the kernel it dispatches, the FLOPs torch's FLOP counter counts, the bytes of the kernel's inputs and
output. Its saved-for-backward bytes, and QK-norm's, are checked block by block for every family against autograd's
saved tensors (tests/memory/test_activations.py)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from kiln.memory.estimate import NUMERICS, Target
from kiln.models import ModelConfig
from kiln.models.attention_costs import ATTENTION
from kiln.models.parts import SDPA

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class Ops(TorchDispatchMode):
    """The aten ops a forward runs, with the tensors each reads and writes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.calls.append((func, [a for a in args if isinstance(a, torch.Tensor)],
                           [o for o in outs if isinstance(o, torch.Tensor)]))
        return out


def shape(dropout: float) -> ModelConfig:
    # grouped-query (4 query heads over 2 key/value heads), odd sizes
    return ModelConfig(preset="llama-125m", n_layer=1, d_model=56, n_head=4, n_kv_head=2, head_dim=14,
                       vocab_size=256, dropout=dropout).resolve()


def qkv(cfg, B, T, dtype=torch.float32):
    H, KV, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    return (torch.randn(B, H, T, D, dtype=dtype), torch.randn(B, KV, T, D, dtype=dtype),
            torch.randn(B, KV, T, D, dtype=dtype))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_backend_is_the_kernel_torch_runs_on_a_cpu(dropout):
    cfg = shape(dropout)
    core = SDPA(cfg.dropout).train()
    ops = Ops()
    with ops:
        core(*qkv(cfg, 2, 7))
    ran = {func for func, _, _ in ops.calls}
    claimed = ATTENTION.backend(cfg, NUMERICS["fp32"], Target("cpu"))
    assert claimed == ("flash" if dropout == 0 else "math")
    assert (FLASH_CPU in ran) == (claimed == "flash"), ran
    assert (torch.ops.aten.bmm.default in ran) == (claimed == "math"), ran  # the math path's two products


@pytest.mark.parametrize("B,T", [(2, 7), (3, 24)])
def test_flops_equal_torchs_count(B, T):
    """torch's FLOP counter has no formula for the CPU flash kernel; the math path (dropout on) runs q·kᵀ and p·v as
    bmm, which it counts over the full (T, T) square: the part's count without the causal half."""
    cfg = shape(0.1)
    with FlopCounterMode(display=False) as counter:
        SDPA(cfg.dropout).train()(*qkv(cfg, B, T))
    assert counter.get_total_flops() == ATTENTION.flops(cfg, B * T, T, causal_kernel=False)
    assert ATTENTION.flops(cfg, B * T, T, causal_kernel=True) == counter.get_total_flops() / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_io_bytes_are_the_kernels_inputs_and_output(dtype):
    """The fused kernel reads q, k and v (k and v at n_kv_head heads: no expanded copy) and writes the output."""
    cfg, B, T = shape(0.0), 3, 11
    ops = Ops()
    with ops:
        SDPA(0.0)(*qkv(cfg, B, T, dtype))
    (ins, outs), = [(i, o) for func, i, o in ops.calls if func == FLASH_CPU]
    moved = sum(t.nbytes for t in ins) + outs[0].nbytes  # outs[1] is the fp32 logsumexp, saved, not streamed
    assert ATTENTION.io_bytes(cfg, B * T, T, dtype.itemsize, fused=True) == moved
