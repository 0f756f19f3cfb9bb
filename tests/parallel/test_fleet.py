"""Runs that survive: 2 "nodes" on 127.0.0.1 under torchrun --max-restarts with a worker killed, a rank that hangs,
a rank preempted alone, a straggler (CPU, gloo).

Two launch groups: the 2-node elastic launch here (two torchrun agents, c10d rendezvous, one worker each), and
tests/parallel/worker.py's 2-process launch (conftest's `launched`), whose last scenarios are the hang, the preemption
and the straggler.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from kiln.cli.main import main
from kiln.config import to_toml
from kiln.parallel import ParallelConfig
from kiln.parallel.elastic import restart_record
from kiln.parallel.watchdog import CollectiveError
from kiln.run.lm import train
from kiln.train.checkpoint import verify
from kiln.report.figures import event_rows
from kiln.report.runs import read_run
from tests.parallel.conftest import ROOT
from tests.parallel.scenarios import lm_config
from tests.parallel.test_dist import assert_close_curves, losses, records


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory, source, kiln_cache):
    """Two torchrun agents (--nnodes=2, one worker each) on 127.0.0.1, each "node" with its own data cache
    (data.cache_per_node=true), --max-restarts=1, the same `kiln train --auto-resume` command line; on the first
    attempt rank 1 SIGKILLs itself right after step 6 (checkpoints every 4 steps)."""
    out = tmp_path_factory.mktemp("two-nodes")
    cfg = lm_config(source, "ddp", steps=10)
    cfg.checkpoint.interval = 4
    (out / "run.toml").write_text(to_toml(cfg))
    port = _free_port()
    # Each round of the rendezvous gets a fresh store: with torchrun's shared one, a restarted rank can read the
    # dead rank's gloo address from the previous round and fail to connect (docs/distributed.md).
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               KILN_TEST_KILL="1@6")
    procs = []
    for node in (0, 1):
        (out / f"cache{node}").mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
             "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--max-restarts=1",
             "--monitor-interval=0.2", str(ROOT / "tests" / "parallel" / "elastic_entry.py"), "train",
             str(out / "run.toml"), "--run-dir", str(out / "run"), "--auto-resume", "--data.cache_per_node=true"],
            cwd=ROOT, env=env | {"KILN_CACHE": str(out / f"cache{node}")}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    return out, [p.returncode for p in procs], logs


def test_two_nodes_survive_a_killed_worker_and_train_as_one_process(two_nodes, reference):
    out, codes, logs = two_nodes
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    run = out / "run"
    # the finished run's curve is the uninterrupted one-process run's, every step once
    assert [r["step"] for r in records(run, "train")] == list(range(1, 11))
    assert_close_curves(losses(run), losses(reference / "lm"))
    assert records(run, "eval")[-1]["val_loss"] == pytest.approx(records(reference / "lm", "eval")[-1]["val_loss"],
                                                                 rel=1e-6)
    # one restart record: resumed at the step-4 checkpoint, steps 5-6 trained again (their records set aside)
    assert [r for r in records(run, "event") if r["event"] == "restart"] == [
        {"kind": "event", "event": "restart", "step": 4, "restarts": 1, "steps_lost": 2}]
    assert [json.loads(line)["step"] for line in (run / "metrics.stale-1.jsonl").read_text().splitlines()] == [5, 6]
    # the survivor, SIGTERMed by torchrun while its peer was dead, saved nothing: no checkpoint of step 6 or 7
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000004", "step_000008",
                                                                          "step_000010"]
    survivor = "".join(logs)
    assert "all_reduce in step 7 failed: rank 1 never reached it (dead or hung)" in survivor
    # each node's local rank 0 prepared the data cache on its own "disk"
    for node in (0, 1):
        assert list((out / f"cache{node}").glob("*/meta.json")), node


def test_the_report_shows_the_restart(two_nodes):
    out, _, _ = two_nodes
    assert (4, "restart", "restarts 1, steps_lost 2") in event_rows(read_run(out / "run"))


def test_a_hung_rank_is_named_within_the_timeout(launched):
    """parallel.timeout=3: rank 1 sleeps 9 s inside step 3; rank 0 stops after the timeout and the few seconds it
    waits for the other ranks to report, naming rank 1, the step and the collective."""
    got = json.loads((launched / "hang_rank0.json").read_text())
    assert got["missing"] == [1] and got["rank"] == 0
    assert got["step"] == "in step 3"
    assert "rank 0:" in got["error"] and "rank 1 never reached it" in got["error"]
    assert "parallel.timeout=3 s" in got["error"]
    assert 3 <= got["seconds"] < 3 + 3 + 8  # the timeout, the 3 s report window, building the run
    hung = json.loads((launched / "hang_rank1.json").read_text())
    assert hung["error"] is not None  # the hung rank, when it wakes, fails too (its peer is gone)


def test_preemption_of_one_rank_stops_every_rank_at_the_same_step(launched):
    """SIGUSR1 reached rank 1 only, after its step 3: the next sync point (step 4) carries it to every rank."""
    for rank in (0, 1):
        assert json.loads((launched / f"preempt_rank{rank}.json").read_text()) == {"step": 4, "signal": 10}
    run = launched / "preempt"
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000004"]
    assert sorted(p.name for p in (run / "checkpoints" / "step_000004").glob("rank_*.pt")) == [
        "rank_00000.pt", "rank_00001.pt"]


def test_a_straggler_is_named(launched):
    """Rank 1's data is 200 ms late every step: its own time per step is many times rank 0's; named once."""
    events = [e for e in records(launched / "straggler", "event") if e["event"] != "layout"]  # layout: at the start
    assert [(e["event"], e["rank"]) for e in events] == [("straggler", 1)]
    assert events[0]["ratio"] > 1.5 and events[0]["own_ms"] > 200
    assert events[0]["step"] == 3  # three log intervals in a row


def test_a_slow_rank_under_fsdp_is_named(launched):
    """fsdp × 2 (with fp16 loss scaling, recompute and the chunked loss: test_dist's levers run), rank 1's forward
    80 ms slower every step: rank 0 waits for it in every block, so its own steps last as long (whole-step times
    cannot tell them apart); the compute between the collectives names rank 1 in the warning, in metrics.jsonl and
    in the report. The unslowed runs of the launch name no rank."""
    run = launched / "levers"
    assert all(r["step_time_s"] > 0.08 for r in records(run, "train"))  # rank 0's steps: as slow as rank 1's
    events = [e for e in records(run, "event") if e["event"] != "layout"]
    assert [(e["event"], e["rank"], e["step"]) for e in events] == [("straggler", 1, 3)]
    assert events[0]["own_ms"] > 80 and events[0]["median_ms"] < events[0]["own_ms"] / 1.5
    assert events[0]["message"].startswith("straggler: rank 1 took ")
    assert events[0]["message"] in (launched / "worker.py.log").read_text()  # the console warning
    assert [(step, detail.startswith("rank 1, ")) for step, event, detail in event_rows(read_run(run))
            if event == "straggler"] == [(3, True)]
    for strategy in ("ddp", "zero1", "fsdp"):
        assert [e for e in records(launched / f"lm_{strategy}", "event") if e["event"] == "straggler"] == []


def test_async_checkpoints_of_two_ranks_resume_exactly(launched, reference, source):
    """checkpoint.async_save=true under ddp × 2 (DCP async_save) for 6 steps, then one process to step 10: the
    uninterrupted run's curve; the step-3 checkpoint, written while steps 4-6 trained, verifies too."""
    run = launched / "async"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000003", "step_000006"]
    verify(run / "checkpoints" / "step_000003")
    train(lm_config(source, "ddp", steps=10), run, resume=True)
    assert_close_curves(losses(run), losses(reference / "lm"))


def test_the_restart_record_counts_the_steps_trained_again(tmp_path, monkeypatch):
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0}) for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_bytes("\n".join(lines).encode() + b"\n\xff\xfe garbage\n")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_record(tmp_path, 4) is None  # a first start: nothing to record
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_record(tmp_path, 4) == {"event": "restart", "step": 4, "restarts": 2, "steps_lost": 3}
    assert restart_record(tmp_path / "none", 0) == {"event": "restart", "step": 0, "restarts": 2, "steps_lost": 0}


def test_fleet_settings_are_checked(capsys):
    for bad, why in ((ParallelConfig(timeout=0), "parallel.timeout must be a number of seconds > 0"),
                     (ParallelConfig(straggler_factor=1.0), "parallel.straggler_factor must be > 1")):
        with pytest.raises(ValueError, match=why):
            bad.validate()
    assert main(["train", "--auto-resume"]) == 2
    assert "--auto-resume needs --run-dir DIR" in capsys.readouterr().err
    assert main(["train", "--auto-resume", "--resume", "x", "--run-dir", "x"]) == 2
    assert "drop --resume RUN_DIR" in capsys.readouterr().err


def test_a_collective_error_names_what_it_knows():
    e = CollectiveError(0, "in step 3", "all_reduce", [1], 3.0, "Timed out")
    assert str(e).startswith("rank 0: all_reduce in step 3 failed: rank 1 never reached it (dead or hung); "
                             "parallel.timeout=3 s (Timed out)")
    assert "missing rank is unknown" in str(CollectiveError(1, "after step 2", "barrier", None, 300, "reset"))
