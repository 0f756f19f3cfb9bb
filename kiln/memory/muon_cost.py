"""What optim.name=muon's update costs: torch.optim.Muon's Newton–Schulz products and elementwise passes.

    is_muon_matrix(name, shape)    whether kiln.train.muon's split gives this parameter to Muon (by name and shape)
    newton_schulz_flops(m, n)      the matmul FLOPs of orthogonalising one m × n update
    muon_cost(shapes) -> MuonCost  FLOPs, bytes and ops of the Muon part of one optimizer step, for the parameters
                                   a rank holds (kiln.memory.estimate.local_parameter_shapes); .seconds(...) on a
                                   device's roofline (kiln.memory.planner.step_time adds it for optim.name=muon)
    muon_line(times, cost)         `kiln plan`'s line: the optimizer's share of the recommended step

torch 2.13's Muon (torch/optim/_muon.py, `_single_tensor_muon`: there is no foreach path) takes one matrix at a time:

    buf.lerp_(g, 1 - μ); u = g.lerp(buf, μ)             Nesterov momentum, in the gradient's dtype (fp32)
    X = u.bfloat16(), transposed when m > n             so X is s × l with s = min(m, n), l = max(m, n)
    X /= ‖X‖                                            norm, clamp, div_
    k = 5 times:  A = X @ X.T                           2·s·s·l FLOPs   (s × l by l × s)
                  B = addmm(A, A, A, beta=b, alpha=c)   2·s·s·s         (s × s by s × s)
                  X = addmm(X, B, X, beta=a)            2·s·s·l         (s × s by s × l)
    p.mul_(1 - lr·wd); p.add_(X, alpha=-lr')            decoupled decay, the update (bf16 into the fp32 parameter)

so k·(4·s²·l + 2·s³) matmul FLOPs per matrix (FlopCounterMode's count: addmm as its product, the beta·C term not
counted; it is s² or s·l more, under 0.1% at s = 384), in bf16 whatever the precision mode: a square n × n matrix
costs 6·k·n³, a tall or wide one ~4·k·m·n·min(m, n). The tiny preset's 24 matrices (d = 384, qkv 1152 × 384,
fc 1536 × 384, proj 384 × 1536 and 384 × 384) cost 95.1 GFLOP a step, 0.7× its forward and backward at batch
8 × 256 (≈ 6 · 10.8 M · 2,048 = 133 GFLOP): on small models and batches the update is not a rounding error.

Parallelism (kiln.parallel.strategy's table): ZeRO-1, FSDP2 and tp refuse Muon (it needs whole matrices; gathering
them is not built), so the only data parallelism with Muon is DDP, where every rank holds the same all-reduced
gradient and orthogonalises every matrix itself: this cost is not divided by the data-parallel degree (AdamW's
elementwise pass under ZeRO-1 or FSDP is). A pipeline stage orthogonalises its own blocks' matrices only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

NS_STEPS = 5  # torch.optim.Muon's ns_steps default (DEFAULT_NS_STEPS), which kiln.train.muon keeps; a test compares
HALF = 2  # bytes: torch's Newton–Schulz runs in bf16 (`grad.bfloat16()`) whatever the parameters' dtype
FULL = 4  # bytes: the gradient, momentum buffer and parameter, fp32 as the planner's AdamW pass counts them
# Per element of a Muon matrix outside the products: buf.lerp_ (read buf and g, write buf: 3 full), g.lerp(buf)
# (2 reads, 1 write: 3 full), .bfloat16() (1 full read, 1 half write), norm (1 half read), div_ (1 half read, 1 half
# write), p.mul_ (2 full), p.add_ (2 full and the half update read): 11 full and 5 half passes, 54 bytes.
ELEMENTWISE_BYTES = 11 * FULL + 5 * HALF
# Ops per matrix (each a kernel, each paying the device's per-op time): lerp_, lerp, bfloat16, norm, clamp, div_,
# the k·3 products, mul_, add_.
OPS_OUTSIDE_PRODUCTS = 8


def is_muon_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """kiln.train.muon's split read off a parameter's name and shape: every 2-D weight but the embeddings, the head
    and an MoE router (a stacked (E, out, in) expert weight is 3-D: AdamW's)."""
    top, last = name.split(".")[0], name.rsplit(".", 2)[-2] if name.count(".") else ""
    return len(shape) == 2 and top not in ("embed", "pos_embed", "head") and last != "router"


def newton_schulz_flops(m: int, n: int, steps: int = NS_STEPS) -> int:
    """Matmul FLOPs of torch's Newton–Schulz on an m × n update: steps · (4·s²·l + 2·s³), s = min, l = max."""
    s, l = min(m, n), max(m, n)
    return steps * (4 * s * s * l + 2 * s ** 3)


def _products(m: int, n: int) -> tuple[tuple[int, int], ...]:
    """(FLOPs, bf16 bytes read and written) of one iteration's three products on an m × n update."""
    s, l = min(m, n), max(m, n)
    return ((2 * s * s * l, HALF * (2 * s * l + s * s)),        # A = X @ X.T: X twice, A written
            (2 * s ** 3, HALF * 4 * s * s),                     # B = b·A + c·A @ A: A three times, B written
            (2 * s * s * l, HALF * (s * s + 3 * s * l)))        # X = a·X + B @ X: B, X twice, X written


@dataclass(frozen=True)
class MuonCost:
    """The Muon part of one optimizer step on one rank."""
    matrices: int  # hidden matrices Muon orthogonalises
    params: int  # their elements (AdamW steps the rest)
    flops: int  # Newton–Schulz matmul FLOPs, bf16
    matmul_bytes: int  # the products' bf16 operands read and results written
    elementwise_bytes: int  # momentum, Nesterov, cast, normalisation, decay and update passes
    ops: int  # kernels launched
    products: tuple[tuple[int, int, int], ...]  # (FLOPs, bytes, how many) per distinct product: each its own roofline

    def seconds(self, peak: float, bandwidth: float, matmul_efficiency: float, bandwidth_efficiency: float,
                op_s: float) -> float:
        """Each product at the slower of its FLOPs at `peak` (the device's bf16 rate) and its bytes at the bandwidth,
        the elementwise passes at the bandwidth, and the per-op time of every kernel."""
        mm = sum(count * max(f / (peak * matmul_efficiency), b / (bandwidth * bandwidth_efficiency))
                 for f, b, count in self.products)
        return mm + self.elementwise_bytes / (bandwidth * bandwidth_efficiency) + self.ops * op_s


def muon_cost(shapes, steps: int = NS_STEPS) -> MuonCost:
    """The Muon part of a step for these (name, shape) parameters (a rank's: its stage, before any sharding)."""
    counts: dict[tuple[int, int], int] = {}
    for name, shape in shapes:
        if is_muon_matrix(name, shape):
            counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    products: dict[tuple[int, int], int] = {}
    for (m, n), c in counts.items():
        for f, b in _products(m, n):
            products[(f, b)] = products.get((f, b), 0) + steps * c
    return MuonCost(matrices=sum(counts.values()), params=sum(math.prod(s) * c for s, c in counts.items()),
                    flops=sum(newton_schulz_flops(m, n, steps) * c for (m, n), c in counts.items()),
                    matmul_bytes=sum(b * c for (_, b), c in products.items()),
                    elementwise_bytes=sum(ELEMENTWISE_BYTES * m * n * c for (m, n), c in counts.items()),
                    ops=sum((OPS_OUTSIDE_PRODUCTS + 3 * steps) * c for c in counts.values()),
                    products=tuple((f, b, c) for (f, b), c in products.items()))



def muon_line(times: dict, cost: MuonCost) -> str:
    """`kiln plan`'s line for a muon candidate: the optimizer's share of its predicted step (`times`, step_time's),
    Muon's part of it, and what that part is (`cost`, the model's)."""
    return (f"optimizer (recommended): {times['optimizer']:.4g} s of the {times['total']:.4g} s step "
            f"({times['optimizer'] / times['total']:.0%}); of it Muon {times['muon']:.4g} s: the model's "
            f"{cost.matrices} hidden matrices, {cost.flops / 1e9:.4g} GFLOP of bf16 Newton-Schulz a step on every "
            f"data-parallel rank (kiln.memory.muon_cost); AdamW the rest")
