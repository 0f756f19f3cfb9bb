"""LM head + cross-entropy over chunks of tokens: the [N x V] fp32 logits never exist at once.

Plain PyTorch. Forward keeps only the head's input h, the per-token logsumexp (N fp32 values) and the targets;
backward recomputes one chunk of logits at a time and turns it into the chunk's gradient (softmax − one-hot),
so the peak of the loss is a chunk × V instead of 3 × N × V fp32 (log-probs, their gradient, the logits'
gradient). The price is the head matmul once more in backward (2·N·V·d FLOPs).

Drop-in for kiln.models.transformer.LMLoss: `model.loss = ChunkedLMLoss(4096)`; the sum of token losses in fp32,
targets equal to IGNORE_INDEX skipped. Under autocast the matmuls run in the autocast dtype as LMLoss's do.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kiln.errors import KilnError
from kiln.models.transformer import IGNORE_INDEX


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return h.dtype


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int):  # h (N, C), weight (V, C), targets (N,)
        dtype = _compute_dtype(h)
        hc, wc = h.to(dtype), weight.to(dtype)
        valid = targets != IGNORE_INDEX
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            stop = min(start + chunk, h.shape[0])
            logits = (hc[start:stop] @ wc.t()).float()  # (n, V) fp32, as LMLoss does
            lse[start:stop] = torch.logsumexp(logits, dim=-1)
            t = targets[start:stop].clamp(min=0)
            picked = logits.gather(1, t[:, None]).squeeze(1)
            total += ((lse[start:stop] - picked) * valid[start:stop]).sum()
        ctx.save_for_backward(hc, weight, targets, lse)
        ctx.chunk, ctx.dtype, ctx.h_dtype = chunk, dtype, h.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hc, weight, targets, lse = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        wc = weight.to(dtype)
        grad_h = torch.empty_like(hc) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hc.shape[0], chunk):
            stop = min(start + chunk, hc.shape[0])
            g = (hc[start:stop] @ wc.t()).float().sub_(lse[start:stop, None]).exp_()  # softmax, in place
            t = targets[start:stop]
            valid = t != IGNORE_INDEX
            g[torch.arange(stop - start, device=g.device), t.clamp(min=0)] -= 1.0
            g *= (grad_total * valid)[:, None]
            g = g.to(dtype)
            if grad_h is not None:
                grad_h[start:stop] = g @ wc
            if grad_w is not None:
                grad_w.add_(g.t() @ hc[start:stop])  # accumulated in fp32
            del g  # before the next chunk's logits exist
        if grad_h is not None:
            grad_h = grad_h.to(ctx.h_dtype)
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None


class ChunkedLMLoss(nn.Module):
    """Same contract as LMLoss (sum of token losses, fp32) computed `chunk` tokens at a time."""

    def __init__(self, chunk: int = 4096):
        super().__init__()
        if chunk < 1:
            raise KilnError(f"memory.chunked_loss={chunk}: a chunk holds ≥ 1 tokens", key="memory.chunked_loss",
                            value=chunk, fix="give the tokens per chunk (≥ 1), or leave the plain loss (0: off)")
        self.chunk = chunk

    def forward(self, h, weight, targets):
        return ChunkedCrossEntropy.apply(h, weight, targets, self.chunk)

    def extra_repr(self) -> str:
        return f"chunk={self.chunk}"
