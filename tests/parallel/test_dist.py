"""Data parallelism on CPU with gloo: 2 processes (one torchrun launch) against 1 process, for DDP, ZeRO-1, FSDP2.

Tolerance 1e-6 relative: the two runs add the same fp32 numbers in a different order (a micro-batch's gradient
sum on each rank, then the all-reduce, against two micro-batches accumulated on one), which moves the last bits of
each step (~1e-7 relative, measured 5e-8 over 10 steps); AdamW then carries those differences forward without
growing them much in 10 steps. A real error (a loss not normalised over the global batch, a rank training on the
wrong data) moves step 2's loss by 1e-3 or more.
"""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.parallel import ParallelConfig, init_world
from kiln.memory.estimate import Target, data_parallel, rank_state
from kiln.memory.levers import job_of
from kiln.run.lm import train
from tests.parallel.scenarios import lm_config

RTOL = 1e-6
STRATEGIES = ("ddp", "zero1", "fsdp")


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def assert_close_curves(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=RTOL), step


def assert_close_weights(a: Path, b: Path):
    wa, wb = (load_file(str(p / "checkpoints" / "latest").replace("latest", _latest(p)) + "/model.safetensors")
              for p in (a, b))
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=RTOL, atol=1e-7, msg=key)


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_train_as_one_process(launched, reference, strategy):
    assert_close_curves(losses(launched / f"lm_{strategy}"), losses(reference / "lm"))
    assert_close_weights(launched / f"lm_{strategy}", reference / "lm")
    got, want = records(launched / f"lm_{strategy}", "eval"), records(reference / "lm", "eval")
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=RTOL)  # validation sharded, summed
    train_records = records(launched / f"lm_{strategy}", "train")
    if strategy == "fsdp":  # FSDP2 has no hook to time its collectives
        assert all("comm_s" not in r for r in train_records)
    else:  # DDP's all-reduces, timed through its comm hook: in flight for part of every step
        assert all(0 < r["comm_s"] < r["step_time_s"] for r in train_records)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_uneven_valid_counts_across_ranks_are_normalised_globally(launched, reference, strategy):
    """fit() with ignored labels: the ranks' micro-batches hold different numbers of valid samples."""
    assert_close_curves(losses(launched / f"fit_{strategy}"), losses(reference / "fit"))
    assert_close_weights(launched / f"fit_{strategy}", reference / "fit")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_mixture_of_experts_trains_as_one_process(launched, moe_reference, strategy):
    """Qwen3-MoE nano (8 experts, 2 per token, the load-balancing loss in the objective) under DDP and FSDP2 (each
    expert's weights sharded like any block's): the one-process losses to 1e-5 relative (measured: ddp equal,
    fsdp ≤ 1.1e-7, on the 2-core Xeon with AMX) and weights to 1e-5 absolute (measured: ddp equal, fsdp 3.9e-6 in
    embed.weight: FSDP2's reduce-scatter sums in another order, and AdamW's m/√v magnifies the last bits of the
    rows whose gradient is near optim.eps; one step moves a weight by up to lr = 2e-3, a wrong normalisation or a
    lost expert gradient by that much). The record's moe_aux_loss and moe_load_* are rank 0's own micro-batches',
    not the global batch's, so they are not compared."""
    run = launched / f"moe_{strategy}"
    got, want = losses(run), losses(moe_reference)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    wa, wb = (load_file(str(p / "checkpoints" / _latest(p) / "model.safetensors")) for p in (run, moe_reference))
    assert wa.keys() == wb.keys() and wa["blocks.0.mlp.experts.fc.weight"].shape[0] == 8  # stacked experts
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-5, msg=key)
    assert records(run, "eval")[-1]["val_loss"] == pytest.approx(records(moe_reference, "eval")[-1]["val_loss"],
                                                                 rel=1e-5)


def test_muon_under_ddp_trains_as_one_process(launched, muon_reference):
    """optim.name=muon under DDP (tests/parallel/scenarios.muon_config, 6 steps): every rank holds whole matrices
    and the same all-reduced gradient, so torch's Muon orthogonalises the same matrix on each; losses, the Muon
    groups' lr and the final weights equal one process's at the data-parallel tolerance (its bf16 Newton-Schulz
    would turn a last-bit gradient difference into a bf16 rounding, ~1e-5 of a weight: the tolerance catches that
    too). ZeRO-1, FSDP2 and tp refuse Muon (tests/train/test_muon.py)."""
    run = launched / "muon_ddp"
    assert_close_curves(losses(run), losses(muon_reference))
    got, want = records(run, "train"), records(muon_reference, "train")
    assert [r["muon_lr"] for r in got] == pytest.approx([r["muon_lr"] for r in want], rel=1e-12)
    assert all(r["muon_lr"] == pytest.approx(r["lr"] * 0.05 / 3e-3, rel=1e-12) for r in got)
    assert_close_weights(run, muon_reference)


def test_resume_on_another_world_size_and_strategy(launched, reference, source):
    """fsdp × 2 for 5 steps, then ddp × 1 (one process, no torchrun) to step 10: the straight run's curve."""
    run_dir = launched / "resume_fsdp"
    train(lm_config(source, "ddp", steps=10), run_dir, resume=True)
    assert_close_curves(losses(run_dir), losses(reference / "lm"))
    # tokens_seen is the global count, before and after the resume on one rank
    assert [r["tokens_seen"] for r in records(run_dir, "train")] == [
        r["tokens_seen"] for r in records(reference / "lm", "train")] == [256 * s for s in range(1, 11)]


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_a_single_process_checkpoint_resumes_on_two_ranks(launched, reference, strategy):
    """One process (no torchrun) for 5 steps, then fsdp × 2 or zero1 × 2 to step 10: the straight run's curve and
    weights (every rank reads the whole checkpoint and keeps its shard)."""
    run_dir = launched / f"from_one_{strategy}"
    assert_close_curves(losses(run_dir), losses(reference / "lm"))
    assert_close_weights(run_dir, reference / "lm")


def test_levers_that_make_sense_with_sharding_run_under_fsdp(launched):
    """FSDP2 with fp16 loss scaling and its per-tensor telemetry, every-2-blocks recompute and the chunked loss."""
    run_dir = launched / "levers"
    curve = losses(run_dir)
    assert len(curve) == 4 and all(0 < v < 10 for v in curve.values())
    telemetry = [e for e in records(run_dir, "numerics") if e["event"] == "fp16_grads"]
    assert [e["step"] for e in telemetry] == [1, 2, 4]  # gradients of every shard measured


def test_a_nan_on_one_rank_is_skipped_on_every_rank(launched):
    run_dir = launched / "nan"
    events = records(run_dir, "numerics")
    assert [e["step"] for e in events if e["event"] == "nonfinite"] == [4]
    assert len(losses(run_dir)) == 8  # the run finished
    report = json.loads((run_dir / "nonfinite_report.json").read_text())
    assert report["rank"] == 1 and report["module"] == "blocks.1.attn" and report["step"] == 4
    # the update was withheld everywhere: the ranks still hold the same weights (DDP checks nothing; compare)
    assert records(run_dir, "train")[-1]["skipped_steps"] == 1


def test_one_writer_per_file(launched):
    run_dir = launched / "lm_ddp"
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 11))  # no line twice
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000010"]
    ckpt = run_dir / "checkpoints" / "step_000010"
    assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_bad_launches_are_clear(launched, monkeypatch):
    assert "cannot be shared by 2 ranks" in (launched / "bad_global.txt").read_text()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="lacks LOCAL_RANK, MASTER_ADDR, MASTER_PORT; launch with torchrun"):
        init_world(ParallelConfig(strategy="ddp"), "cpu")
    for key, value in (("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="parallel.strategy=none would train 2 independent copies"):
        init_world(ParallelConfig(strategy="none"), "cpu")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_rank_state_bytes_equal_the_estimate(launched, strategy, source):
    """Rank 0's parameters, gradients and optimizer state, measured on CPU, are the estimator's per-rank bytes."""
    cfg = lm_config(source, strategy, steps=10)
    model = cfg.model.resolve()
    model.vocab_size = 256
    job = job_of(cfg, model, "fp32", Target("cpu"), world=2)
    measured = json.loads((launched / "state_bytes.json").read_text())[strategy]
    assert measured == rank_state(job)
    if strategy != "ddp":  # sharding really saves: less than one replica's state
        assert measured["optimizer_states"] < rank_state(replace(job, plan=data_parallel(job.parallel, 1)))["optimizer_states"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eval_tasks_split_over_ranks_score_as_one_process(launched, strategy):
    """train.eval_tasks under torchrun: each rank scored its share of the rows and the log-likelihoods were summed;
    the final eval record equals the tasks scored again in this one process on the run's final checkpoint."""
    from kiln.evaluate import load_tasks, prepare, score_task
    from kiln.run.source import load_source

    run = launched / f"lm_{strategy}"
    logged = records(run, "eval")[-1]
    source = load_source(run, device="cpu")
    tasks = load_tasks([str(launched / "eval_tasks" / "mc.jsonl"), f"text:{launched / 'eval_tasks' / 'doc.txt'}"])
    mc, doc = (score_task(source.model, prepare(t, source.tokenizer, 64), vocab=source.model_cfg.vocab_size,
                          max_length=64) for t in tasks)
    assert logged["task_mc_acc"] == mc.results["acc,none"]
    assert logged["task_mc_acc_norm"] == mc.results["acc_norm,none"]
    assert logged["task_mc_acc_stderr"] == pytest.approx(mc.results["acc_stderr,none"], rel=1e-12)
    assert logged["task_doc_bpb"] == pytest.approx(doc.results["bits_per_byte,none"], rel=1e-6)
