"""Tensor-parallel layout in one process: every bad layout's one-line error (ParallelPlan, init_world), and the fused
rows' reordering (kiln.parallel.tensor) checked against a column split done by hand."""
import pytest
import torch

from kiln.models import ModelConfig
from kiln.models.registry import family
from kiln.parallel import ParallelConfig, init_world
from kiln.parallel.layout import ParallelPlan
from kiln.parallel.fused import canonical, from_canonical, tp_order


def llama(**kw):
    return ModelConfig(**({"preset": "llama-125m", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64,
                           "d_ff": 96, "vocab_size": 256} | kw)).resolve()


def build(world, model=None, **parallel):
    cfg = model or llama()
    return ParallelPlan.build(ParallelConfig(**parallel), world, cfg, family(cfg.arch))


@pytest.mark.parametrize("world,model,parallel,message", [
    (6, None, {"tp": 4, "strategy": "fsdp"}, "6 processes do not divide into parallel.tp=4"),
    (4, None, {"tp": 4}, "parallel.tp=4 does not divide model.n_kv_head = 2"),
    # mlp.fc's 180 rows divide by 4, but its parts (gate, up) of 90 do not
    (4, llama(n_kv_head=4, d_ff=90), {"tp": 4}, "parallel.tp=4 does not divide part 1 of mlp.fc"),
    (4, None, {"tp": 2}, "leave 2 data-parallel copies, but parallel.strategy=none"),
    (4, None, {"tp": 2, "strategy": "zero1"}, "parallel.strategy=zero1 (ZeroRedundancyOptimizer) cannot hold"),
    (2, None, {"sequence_parallel": True, "strategy": "ddp"}, "it needs --parallel.tp > 1"),
    # every head and width divides by 3, the vocabulary of 256 (padded: 256) does not
    (3, llama(n_head=6, n_kv_head=3, d_model=96, d_ff=96), {"tp": 3},
     "parallel.tp=3 does not divide the padded vocabulary model.padded_vocab"),
])
def test_bad_layouts_are_one_line_errors(world, model, parallel, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        build(world, model, **parallel)
    assert "\n" not in str(e.value)


def test_tp_needs_torchrun(monkeypatch):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="launch with torchrun --nproc_per_node=2"):
        init_world(ParallelConfig(tp=2), "cpu")


def test_a_good_layout():
    plan = build(8, tp=2, strategy="fsdp", sequence_parallel=True)
    assert plan.mesh_shape == {"pp": 1, "dp": 4, "tp": 2}
    # a mixture of experts: attention split, router and experts whole on each tp rank; and in pipeline stages
    moe = build(4, ModelConfig(preset="qwen3-moe-nano").resolve(), tp=2, pp=2, strategy="ddp")
    assert moe.mesh_shape == {"pp": 2, "dp": 1, "tp": 2}
    assert [plan.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp ranks of a copy: one dp rank


@pytest.mark.parametrize("parts", [(8, 4, 4), (6, 6)])
def test_fused_rows_give_each_rank_its_share_of_every_part(parts):
    """Rank r's contiguous block in TP order is [part_1 rows of r; part_2 rows of r; ...]: what a column split of each
    part separately gives, and what a plain split of the fused weight does not."""
    tp, w = 2, torch.randn(sum(parts), 5, dtype=torch.float64)
    pieces = w.split(list(parts))
    reordered = from_canonical(w, parts, tp)
    for r, block in enumerate(reordered.chunk(tp)):
        torch.testing.assert_close(block, torch.cat([p.chunk(tp)[r] for p in pieces]), rtol=0, atol=0)
    assert not torch.equal(reordered.chunk(tp)[0], w.chunk(tp)[0])
    torch.testing.assert_close(canonical(reordered, parts, tp), w, rtol=0, atol=0)
    assert sorted(tp_order(parts, tp).tolist()) == list(range(sum(parts)))


def test_the_plan_answers_which_ranks_and_what_a_rank_holds():
    """ranks_of and holds against the mesh written out by hand: pp2 × dp2 × tp2 over 8 ranks, tp innermost."""
    plan = build(8, llama(n_layer=4), tp=2, pp=2, strategy="fsdp")
    # rank = pp·4 + dp·2 + tp
    assert plan.ranks_of("tp", 5) == [4, 5]
    assert plan.ranks_of("dp", 5) == [5, 7]
    assert plan.ranks_of("pp", 5) == [1, 5]
    held = plan.holds(7, n_layer=4)
    assert (held["stage"], held["blocks"], held["tp_shard"], held["dp_copy"]) == (1, [2, 3], 1, 1)


def test_world_asks_its_plan_for_the_layout():
    """A World keeps no degrees of its own: strategy, dp size and rank are the laid-out plan's."""
    from kiln.parallel import World

    world = World(rank=6, size=8, plan=None)
    world.lay_out(build(8, tp=2, strategy="fsdp"))
    assert (world.strategy, world.dp_size, world.dp_rank, world.sharded) == ("fsdp", 4, 3, True)
    with pytest.raises(ValueError, match="a plan for 4 ranks laid over a world of 8"):
        world.lay_out(build(4, tp=2, strategy="fsdp"))
