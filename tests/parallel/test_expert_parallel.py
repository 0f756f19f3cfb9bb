"""Expert parallelism on CPU with gloo: 4 processes (one torchrun launch, tests/parallel/ep_worker.py) as ep2 over
dp4 (FSDP2), ep2 with tp2 (dp2, DDP as FSDP2's replicate; with sequence parallelism under FSDP2 in the resume) and
ep2 with pp2 (dp2, FSDP2; each stage's experts over its dp group, 1F1B over 2 pipeline micro-batches) against 1
process, Qwen3-MoE nano (8 experts, 2 per
token, the load-balancing loss on), the same global batch and seed, fp32, 10 steps; checkpoints resharded between
the layouts and one process; the all-to-all's split sizes against a hand count; the host syncs of a step; each
rank's step peaks (benchmarks/ep_rank_peaks.py's ep2 scenarios) against the memory estimate.

Tolerances: losses 1e-5 relative; weights 1e-5 absolute, as tests/parallel/test_dist.py's MoE parity: the
4-process runs add the same fp32 numbers in another order (an expert's weight gradient sums its pairs from the ep
group in one product, the gradients are reduced over dp), which moves the last bits of each step (~1e-7), and
AdamW's m/√v turns a last-bit difference of a gradient near optim.eps into a step of up to lr (2e-3): the tests'
eps is 1e-6 (scenarios.ep_config says why, with numbers). A real error is far larger: an expert gradient averaged
over dp/ep rather than dp doubles the experts' part of the gradient norm at step 1, a pair sent to the wrong rank
changes the loss at step 1. Measured on the 2-core Xeon with AMX (2026-11-27): losses ≤ 1.5e-7 relative, gradient
norms ≤ 2.7e-6, weights ≤ 1.1e-6.
"""
import json

import pytest
import torch

from benchmarks.ep_rank_peaks import SCENARIOS, SHAPE
from kiln.config import load_config
from kiln.memory.devices import get_device
from kiln.memory.estimate import estimate, peak_allocated
from kiln.memory.levers import rank_jobs
from kiln.models.registry import family
from kiln.run.lm import train
from tests.parallel.conftest import final_weights, one_thread, torchrun
from tests.parallel.scenarios import ep_config, rewound
from tests.parallel.test_dist import losses, records

RTOL, ATOL = 1e-5, 1e-5
# ep_worker.py's hand-made routing: rank r sends ROUTED[r][e] (token, slot) pairs to expert e; ep rank d holds
# experts 2d and 2d + 1
ROUTED = [[3, 0, 1, 4, 0, 0, 2, 5], [0, 1, 0, 0, 6, 2, 1, 1], [2, 2, 2, 2, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 9]]


@pytest.fixture(scope="module")
def ep_reference(tmp_path_factory, source, kiln_cache):
    """The 10 steps in this one process, on one thread as each torchrun rank runs, saved every 3 steps (the
    resumes start at step 6)."""
    out = tmp_path_factory.mktemp("ep-single") / "moe"
    with one_thread():
        train(ep_config(source, "none", interval=3), out)
    return out


@pytest.fixture(scope="module")
def ep_launched(tmp_path_factory, source, ep_reference):
    """One torchrun launch of tests/parallel/ep_worker.py on 4 processes; its wall time is printed (-s shows it)."""
    out = tmp_path_factory.mktemp("ep")
    rewound(ep_reference, out / "one_to_ep2_tp2", step=6)  # the one-process run's step 6, resumed as ep2 × tp2
    print(f"expert-parallel launch: {torchrun('ep_worker.py', out, source, nproc=4):.1f} s")
    return out


def grad_norms(run_dir) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in records(run_dir, "train")}


def assert_same_run(got_dir, want_dir):
    got, want = losses(got_dir), losses(want_dir)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=RTOL), step
    # AdamW's update hardly sees a gradient's scale, the norm does (measured ≤ 2.7e-6 relative): an expert
    # gradient averaged over dp/ep rather than dp would move it by far more from step 1
    got, want = grad_norms(got_dir), grad_norms(want_dir)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    wg, ww = final_weights(got_dir), final_weights(want_dir)
    assert wg.keys() == ww.keys() and "blocks.1.mlp.experts.fc.weight" in wg  # every expert, consolidated
    for key in ww:
        torch.testing.assert_close(wg[key], ww[key], rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("run", ["ep2", "ep2_tp2", "ep2_pp2"])
def test_expert_parallel_trains_as_one_process(ep_launched, ep_reference, run):
    assert_same_run(ep_launched / run, ep_reference)


def test_a_one_process_checkpoint_resumes_as_ep2_with_tp2(ep_launched, ep_reference):
    """1 process for 6 steps, then ep2 × tp2 with sequence parallelism under FSDP2 (the stacked experts resharded
    over ep, attention over tp) to 10."""
    assert_same_run(ep_launched / "one_to_ep2_tp2", ep_reference)


def test_an_ep2_checkpoint_resumes_in_one_process(ep_launched, ep_reference, source, tmp_path):
    """ep2 over dp4 saved at step 6, resumed by one process (no torchrun): the straight curve."""
    run_dir = rewound(ep_launched / "ep2", tmp_path / "resumed", step=6)
    with one_thread():
        train(ep_config(source, "ddp"), run_dir, resume=True)
    assert_same_run(run_dir, ep_reference)


def expected_bytes(ep: int, tp: int, fsdp_shards: int, keep=lambda name: True) -> int:
    """One rank's parameter bytes: each expert weight 1/ep (whole experts), attention's split linears and the
    vocabulary 1/tp, the rest whole; FSDP then holds 1/fsdp_shards of that (the experts' dp_mod_ep = the others'
    dp / ep). keep(name): the parameters the rank holds (a pipeline stage's)."""
    cfg = ep_config("", "none").model
    cfg.vocab_size = 256
    cfg = cfg.resolve()
    fam = family(cfg.arch)
    roles = {lin.name: lin.tp for lin in fam.linears(cfg)}
    total = 0
    for name, shape in fam.parameter_shapes(cfg):
        if not keep(name):
            continue
        numel = torch.Size(shape).numel()
        module = name.split(".", 2)[-1].rpartition(".")[0] if name.startswith("blocks.") else name.rpartition(".")[0]
        if roles.get(module) == "expert":
            total += numel // ep // (fsdp_shards // ep if fsdp_shards > 1 else 1)
            continue
        split = roles.get(module) in ("column", "row") or module in ("embed", "head")
        total += numel // tp // fsdp_shards if split else numel // fsdp_shards
    return 4 * total


@pytest.mark.parametrize("run,tp,fsdp_shards", [("ep2", 1, 4), ("ep2_tp2", 2, 1)])
def test_the_layout_record_shows_ep(ep_launched, run, tp, fsdp_shards):
    """The mesh gains ep (beside dp, not a factor of the world); each rank holds its 4 of 8 experts."""
    event, = [e for e in records(ep_launched / run, "event") if e["event"] == "layout"]
    assert event["mesh"] == {"pp": 1, "dp": 4 // tp, "tp": tp, "ep": 2}
    assert event["param_bytes_per_rank"] == [expected_bytes(2, tp, fsdp_shards)] * 4
    assert event["param_bytes_unsharded"] == expected_bytes(1, 1, 1)


def test_the_layout_record_of_ep2_with_pp2(ep_launched):
    """Ranks 0 and 1 (stage 0: the embedding and block 0) and 2 and 3 (stage 1: block 1, the norm and the head)
    each hold 4 of their blocks' 8 experts and half of the rest (FSDP2 over dp2)."""
    event, = [e for e in records(ep_launched / "ep2_pp2", "event") if e["event"] == "layout"]
    assert event["mesh"] == {"pp": 2, "dp": 2, "tp": 1, "ep": 2}
    last = ("blocks.1.", "norm.", "head.")
    first, second = (expected_bytes(2, 1, 2, keep=lambda n, s=s: n.startswith(last) == s) for s in (False, True))
    assert event["param_bytes_per_rank"] == [first, first, second, second]
    assert event["param_bytes_unsharded"] == expected_bytes(1, 1, 1)


def test_split_sizes_against_a_hand_count(ep_launched):
    """Rank r sends to ep rank d the pairs of experts 2d, 2d + 1; receives from each source s its pairs for r's."""
    got = json.loads((ep_launched / "ep_results.json").read_text())["splits"]
    # counted by hand from ROUTED: rank 0 sends 3+0, 1+4, 0+0, 2+5; receives 3+0 (from 0), 0+1, 2+2, 0+0 ...
    assert [g["sent"] for g in got] == [[3, 5, 0, 7], [1, 0, 8, 2], [4, 4, 0, 0], [0, 1, 0, 9]]
    assert [g["got"] for g in got] == [[3, 1, 4, 0], [5, 0, 4, 1], [0, 8, 0, 0], [7, 2, 0, 9]]
    assert got[1]["received"] == [[1, 4], [0, 0], [2, 2], [0, 1]]  # (source, local expert) for experts 2, 3
    for r, g in enumerate(got):
        assert g["sent"] == [sum(ROUTED[r][2 * d:2 * d + 2]) for d in range(4)]


def test_one_host_sync_per_moe_block(ep_launched):
    """At ep2 a forward and backward reads the split sizes back once per MoE block (their .tolist(), before the
    variable all-to-all: the sizes must be on the host) and nothing else (tests/train/test_host_syncs.py's
    counter); at ep = 1 the step has none (kiln.models.moe, the same test file)."""
    results = json.loads((ep_launched / "ep_results.json").read_text())
    assert results["blocks"] == 2
    assert results["syncs"] == ["tolist"] * results["blocks"]


def test_kiln_profile_shows_the_all_to_all_share(ep_launched):
    """kiln profile's all-to-all time (kiln.run.profile): the ep2 run's exchanges timed (seconds > 0, then taken),
    and the report's line with its share of the step."""
    from kiln.perf.bottleneck import Breakdown, Verdict
    from kiln.run.profile import ProfileResult, report_lines

    seconds, again = json.loads((ep_launched / "ep_results.json").read_text())["all_to_all_s"]
    assert seconds > 0 and again == 0
    b = Breakdown(step_s=0.5, parts={"forward": 0.2, "backward": 0.3}, ops=[], device="cpu", peak_flops=1e11,
                  bandwidth=1e10, model_flops_per_step=1e9)
    result = ProfileResult(b, Verdict("compute-bound", ""), {}, 2, all_to_all_s=0.05)
    assert ("  experts' all-to-all 50.00 ms per step, 10.0% of the step (split sizes and tokens, both ways; within "
            "forward and backward)") in report_lines(result)
    assert result.summary()["all_to_all_s"] == 0.05


@pytest.mark.parametrize("scenario", ["ep2 ddp fp32", "ep2 fsdp fp32", "ep2 fsdp bf16"])
def test_rank_peaks_match_the_estimate(ep_launched, scenario):
    """Rank 0's whole-step peak on 4 gloo ranks (ep2 over dp4, kiln.run.measure.measure_rank_peaks: experts, their
    gradients and optimizer state, the all-to-all buffers, the routed activations, the gathers and reductions)
    within 5% of kiln.memory's estimate of that rank, the first step (no optimizer state yet) and the steady one.
    Measured on the 2-core Xeon with AMX (2026-11-27): ddp -2.1% / -0.0%, fsdp fp32 -1.5% / -2.8%, fsdp bf16 -0.3% /
    -1.0%; the estimate before the experts were modelled as their own FSDP2 groups: fsdp +22.5% / +29.7%, bf16
    +16.6% / +23.4%, ddp's first step +25.0% (DDP's buckets: ep runs FSDP2's replicate)."""
    first, *later = json.loads((ep_launched / "ep_peaks.json").read_text())[0][scenario]
    _, jobs = rank_jobs(load_config(None, SHAPE + SCENARIOS[scenario]), get_device("cpu"), 4)
    b = estimate(jobs[0])
    assert peak_allocated(b) == pytest.approx(min(later), rel=0.05)
    assert b.first_step_peak == pytest.approx(first, rel=0.05)
