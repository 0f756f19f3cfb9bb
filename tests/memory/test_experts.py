"""Expert parallelism in the estimator and the planner (issue #41): one rank's experts, their state and the
all-to-all buffers against a hand count; the planner's ep search."""
import math
from dataclasses import dataclass, replace

import pytest

from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import Job, Target, estimate, rank_state
from kiln.memory.experts import expert_parallel, worst_case_note
from kiln.memory.levers import JobSections
from kiln.memory.planner import search, step_time
from kiln.models import ModelConfig, param_count
from kiln.models.registry import family
from kiln.parallel.layout import ParallelPlan

NANO = ModelConfig(preset="qwen3-moe-nano", vocab_size=256).resolve()  # 8 experts, 2 per token, 2 blocks of 256


def plan(world: int, ep: int, strategy: str) -> ParallelPlan:
    """The layout object with ep; before kiln.parallel.layout holds ep (ep41's branch), a stand-in that does."""
    if "ep" in ParallelPlan.__dataclass_fields__:
        return ParallelPlan(world, strategy=strategy, ep=ep)

    @dataclass(frozen=True)
    class WithEP(ParallelPlan):
        ep: int = 1
    return WithEP(world, strategy=strategy, ep=ep)


def job(ep: int, strategy: str = "ddp", world: int = 4, precision: str = "fp32", **kw) -> Job:
    return Job(model=NANO, micro_batch=2, seq_len=64, precision=precision, target=Target("cpu"),
               plan=plan(world, ep, strategy), **kw)


def expert_numel() -> int:
    """One expert of one block: gate/up (2·128 × 256) and down (256 × 128)."""
    return 2 * 128 * 256 + 256 * 128


def test_a_rank_holds_its_experts_and_their_state_by_hand():
    P, L, E = param_count(NANO), NANO.n_layer, NANO.n_experts
    # embed, head, final norm; per block: 2 norms, qkv, q/k norms, proj, router, the stacked experts' fc and proj
    tensors = 3 + L * (2 + 1 + 2 + 1 + 1 + 2)
    assert len(family("qwen3_moe").parameter_shapes(NANO)) == tensors
    for ep in (1, 2, 4, 8):
        kept = P - L * (E - E // ep) * expert_numel()
        s = rank_state(job(ep))
        assert s["parameters"] == s["gradients"] == 4 * kept  # ddp: the rest replicated
        assert s["optimizer_states"] == 8 * kept + 4 * tensors
    # fsdp over 4 ranks with ep 4: an expert's state is data-parallel over dp/ep = 1 rank (whole), the rest over 4
    rest = [(n, s) for n, s in family("qwen3_moe").parameter_shapes(NANO) if ".experts." not in n]
    sharded = sum(math.ceil(s[0] / 4) * math.prod(s[1:]) for _, s in rest)
    s = rank_state(job(4, "fsdp"))
    assert s["parameters"] == 4 * (sharded + L * 2 * expert_numel())
    # ... with ep 2 on 4 ranks: 4 experts a rank, each over dp/ep = 2 ranks (256-row and 256-row shards halve)
    s = rank_state(job(2, "fsdp"))
    assert s["parameters"] == 4 * (sharded + L * 4 * expert_numel() // 2)


def test_all_to_all_buffers_and_the_worst_case():
    one, four = estimate(job(1)), estimate(job(4))
    N, K, d = 2 * 64, 2, 256
    x = expert_parallel(job(4))
    assert x["pairs"] == N * K and x["exchange_bytes"] == 2 * N * K * d * 4  # send and receive, fp32
    assert x["worst_pairs"] == 4 * N * min(K, 8 // 4) and x["imbalance"] == 4.0
    assert x["all_to_all_bytes"] == 4 * 2 * N * K * d * 4 * 3 / 4  # 4 exchanges a block, 3/4 leaves the rank
    assert expert_parallel(job(1))["exchange_bytes"] == 0
    fwd = {name: c for name, c in four.timeline}["forward: block 1"]
    fwd_one = {name: c for name, c in one.timeline}["forward: block 1"]
    # ep runs FSDP2's replicate, not DDP (kiln.memory.experts.expert_comm): a copy of every non-expert parameter,
    # and each block's experts from their forward to their backward (blocks 0 and 1 here), beside the exchange
    P, L, E = param_count(NANO), NANO.n_layer, NANO.n_experts
    assert four.model_state["comm_buffers"] == 4 * (P - L * E * expert_numel())
    experts = 2 * (E // 4) * expert_numel() * 4
    assert fwd["comm_buffers"] - four.model_state["comm_buffers"] == experts + 2 * N * K * d * 4
    assert fwd_one["comm_buffers"] == one.model_state["comm_buffers"]
    assert fwd["activations"] == fwd_one["activations"]  # routed activations as one process's (balanced)
    assert "worst case 1,024 pairs (4× the routed activations" in worst_case_note(job(4))
    # bf16: the exchanged rows are bf16; the time model waits for them
    h100 = get_device("H100")
    t = step_time(replace(job(4, precision="bf16"), target=Target("cuda")), h100)
    assert t["ep_communication"] > 0 and "ep_communication" not in step_time(job(1, precision="bf16"), h100)


def test_plan_searches_expert_parallelism_for_an_moe_only():
    if "ep" not in ParallelPlan.__dataclass_fields__:
        pytest.skip("the layout object has no ep yet (ep41's kiln.parallel.layout)")
    args = ["--model.preset=qwen3-moe-nano", "--data.tokenizer=bpe", "--data.seq_len=128"]
    p = search(JobSections.of(load_config(None, args)), get_device("H100"), 40 * 2**30, 2**13, gpus=4, quick=True)
    eps = [c for c in p.candidates if c.choice.ep > 1]
    assert eps and all(c.times["ep_communication"] > 0 and c.overrides["parallel.ep"] == c.choice.ep for c in eps)
    assert {c.choice.ep for c in eps} <= {2, 4, 8}
    dense = search(JobSections.of(load_config(None, ["--model.preset=llama-125m", "--data.tokenizer=bpe",
                                                     "--data.seq_len=128"])),
                   get_device("H100"), 40 * 2**30, 2**13, gpus=4, quick=True)
    assert all(c.choice.ep == 1 for c in dense.candidates)
