"""Runs that survive: torchrun --max-restarts with a worker killed (one agent, --standalone; and 2 "nodes" on
127.0.0.1), a node lost for good (the other goes on alone, resharded), a rank that hangs, a rank preempted alone,
a straggler (CPU, gloo), all with torchrun's defaults (its shared agent store).

Two launch groups: the elastic launches here (`elastic`: the --standalone one and the two agents, in flight
together), and tests/parallel/worker.py's 2-process launch (conftest's `launched`), whose last scenarios are the
hang, the preemption and the straggler.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def _agents(out: Path, name: str, cfg, kill: str, agents: list[tuple[list[str], dict]]) -> list[subprocess.Popen]:
    """torchrun agents running the same `kiln train --auto-resume` command line (tests/parallel/elastic_entry.py)
    on OUT/NAME/run.toml, with torchrun's defaults: TORCH_DISABLE_SHARE_RDZV_TCP_STORE is removed from the
    environment, so the workers bootstrap from the agent's shared store (kiln.parallel.elastic.round_store)."""
    (out / name).mkdir()
    (out / name / "run.toml").write_text(to_toml(cfg))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KILN_TEST_KILL": kill}
    procs = []
    for args, more in agents:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *args, "--max-restarts=" + more.pop("restarts"),
             "--monitor-interval=0.2", str(ROOT / "tests" / "parallel" / "elastic_entry.py"), "train",
             str(out / name / "run.toml"), "--run-dir", str(out / name / "run"), "--auto-resume",
             "--data.cache_per_node=true"],
            cwd=ROOT, env=env | more, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.fixture(scope="session")
def elastic(tmp_path_factory, source, kiln_cache):
    """Two elastic launches, in flight together (most of their time is restarts and rendezvous waiting):

    standalone: `torchrun --standalone --nproc_per_node=2 --max-restarts=1`, checkpoints every 2 steps, rank 1
      SIGKILLs itself right after step 3 on the first attempt; 5 steps.
    two_nodes: two torchrun agents (--nnodes=1:2, one worker each, c10d rendezvous hosted by node 0's agent), each
      "node" with its own data cache (data.cache_per_node=true), --max-restarts=2, checkpoints every 4 steps,
      train.global_batch_size=8 (1 micro-batch of 4 per rank on 2 ranks). Rank 1 SIGKILLs itself right after
      step 6 on the first attempt (both nodes restart, resume at step 4); after step 10 node 1 goes for good (its
      agent and its worker SIGKILLed), and node 0 goes on alone from the step-8 checkpoint, with 2 micro-batches
      per step, to step 12."""
    out = tmp_path_factory.mktemp("elastic")
    short = lm_config(source, "ddp", steps=5)
    short.checkpoint.interval = 2
    launches = {"standalone": _agents(out, "standalone", short, "1@3", [
        (["--standalone", "--nproc_per_node=2"], {"restarts": "1", "KILN_CACHE": str(out / "cache-standalone")})])}
    cfg = lm_config(source, "ddp", steps=12)
    cfg.checkpoint.interval = 4
    port = _free_port()
    # keep-alive 1 s × 3: node 1's death is seen within ~3 s (torch's default: 5 s × 3); last call 3 s: a round
    # that has its minimum (1 node) waits that long for the other
    rdzv = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    conf = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
    nodes = []
    for node in (0, 1):
        (out / f"cache{node}").mkdir()
        nodes.append((rdzv + [f"--node_rank={node}", f"--rdzv_conf=is_host={int(node == 0)},{conf}"],
                      {"restarts": "2", "KILN_CACHE": str(out / f"cache{node}")} |
                      ({"KILN_TEST_KILL_NODE": "10"} if node == 1 else {})))
    launches["two_nodes"] = _agents(out, "two_nodes", cfg, "1@6", nodes)
    logs = {name: [p.communicate(timeout=300)[0] for p in procs] for name, procs in launches.items()}
    return out, {name: [p.returncode for p in procs] for name, procs in launches.items()}, logs


def test_standalone_survives_a_killed_worker_with_torchruns_defaults(elastic, reference):
    """The command line a user types (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE): the restarted group meets in a
    namespace of its own in the agent's store, resumes at step 2 and trains as one process does."""
    out, codes, logs = elastic
    assert codes["standalone"] == [0], logs["standalone"][0][-3000:]
    assert "elastic_entry: rank 1 TORCHELASTIC_USE_AGENT_STORE=True" in logs["standalone"][0]  # torch's default
    run = out / "standalone" / "run"
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4, 5]
    assert_close_curves(losses(run), {s: v for s, v in losses(reference / "lm").items() if s <= 5})
    assert [r for r in records(run, "event") if r["event"] == "restart"] == [
        {"kind": "event", "event": "restart", "step": 2, "restarts": 1, "steps_lost": 1, "world_size": 2,
         "world_size_before": 2}]


def test_two_nodes_survive_a_killed_worker_then_one_node_goes_on_alone(elastic, reference, source):
    out, codes, logs = elastic
    assert codes["two_nodes"][0] == 0, "\n".join(log[-3000:] for log in logs["two_nodes"])
    assert codes["two_nodes"][1] == -9  # node 1's agent, SIGKILLed
    run = out / "two_nodes" / "run"
    # every step once; up to step 10 the uninterrupted one-process run's curve (the global batch kept throughout)
    assert [r["step"] for r in records(run, "train")] == list(range(1, 13))
    curve = losses(run)
    assert_close_curves({s: v for s, v in curve.items() if s <= 10}, losses(reference / "lm"))
    # tokens_seen is global, across the resume on one rank: 8 sequences × 32 tokens a step
    assert [r["tokens_seen"] for r in records(run, "train")] == [256 * s for s in range(1, 13)]
    # two restart records: the killed worker (both nodes back, world 2), then node 1 gone (world 2 -> 1). The second
    # one's `restarts` is torchrun's count on node 0, which counts a restart only when its own worker failed: its
    # worker may have been stopped (not failed) at the first restart
    first, second = [r for r in records(run, "event") if r["event"] == "restart"]
    assert first == {"kind": "event", "event": "restart", "step": 4, "restarts": 1, "steps_lost": 2, "world_size": 2,
                     "world_size_before": 2}
    assert second | {"restarts": 0} == {"kind": "event", "event": "restart", "step": 8, "restarts": 0,
                                        "steps_lost": 2, "world_size": 1, "world_size_before": 2}
    assert second["restarts"] in (1, 2)
    for n, steps in ((1, [5, 6]), (2, [9, 10])):  # the failed attempts' records, set aside
        assert [json.loads(line)["step"] for line in (run / f"metrics.stale-{n}.jsonl").read_text().splitlines()] == \
            steps
    # the survivors, SIGTERMed while a peer was dead, saved nothing: no checkpoint of step 6, 7, 10 or 11
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000004", "step_000008",
                                                                          "step_000012"]
    survivor = logs["two_nodes"][0]
    assert "TORCHELASTIC_USE_AGENT_STORE=True" in survivor and "TORCHELASTIC_USE_AGENT_STORE=False" not in survivor
    assert "all_reduce in step 7 failed: rank 1 never reached it (dead or hung)" in "".join(logs["two_nodes"])
    assert ("resumed on 1 data-parallel rank, the checkpoint's world had 2: grad_accum_steps 1 → 2 keeps "
            "train.global_batch_size=8") in survivor
    # after the restart: one process resumed from the same step-8 checkpoint, with 2 micro-batches a step
    alone = out / "one_process"
    (alone / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step_000008", alone / "checkpoints" / "step_000008")
    (alone / "checkpoints" / "latest").write_text("step_000008")
    resumed = train(lm_config(source, "ddp", steps=12), alone, resume=True)
    assert resumed.state.world.size == 1 and resumed.state.tokens_seen == 256 * 12
    assert_close_curves({s: v for s, v in curve.items() if s > 8}, losses(alone))
    assert records(run, "eval")[-1]["val_loss"] == pytest.approx(records(alone, "eval")[-1]["val_loss"], rel=1e-6)
    # each node's local rank 0 prepared the data cache on its own "disk"
    for node in (0, 1):
        assert list((out / f"cache{node}").glob("*/meta.json")), node


def test_the_report_shows_the_restarts(elastic):
    out, _, _ = elastic
    rows = [row for row in event_rows(read_run(out / "two_nodes" / "run")) if row[1] == "restart"]
    assert rows[0] == (4, "restart", "restarts 1, steps_lost 2, world_size 2, world_size_before 2")
    assert rows[1][0] == 8 and rows[1][2].endswith("world_size 1, world_size_before 2")


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
    assert restart_record(tmp_path, 4) == {"event": "restart", "step": 4, "restarts": 2, "steps_lost": 3,
                                           "world_size": 1, "world_size_before": None}  # no layout, no checkpoint
    assert restart_record(tmp_path / "none", 0, resumed_world={"size": 4, "dp": 4}) == {
        "event": "restart", "step": 0, "restarts": 2, "steps_lost": 0, "world_size": 1, "world_size_before": 4}
    layout = {"kind": "event", "event": "layout", "mesh": {"dp": 3}, "param_bytes_per_rank": [8, 8, 8]}
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(layout) + "\n")  # the failed attempt's own word on its world wins over the checkpoint's
    assert restart_record(tmp_path, 4, resumed_world={"size": 4, "dp": 4})["world_size_before"] == 3


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


def test_a_restarted_group_meets_in_a_namespace_of_its_own(monkeypatch):
    """round_store against a store that holds the previous round's leader token and keys (as torchrun's shared
    agent store does after a restart), rank 1 starting before rank 0: both ranks get the new round's namespace,
    which holds none of the old keys."""
    from datetime import timedelta
    from threading import Thread

    import torch.distributed as dist

    from kiln.parallel.elastic import round_store

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    server.set("kiln/round/leader", "old")  # the dead round's leader and what its process group wrote
    server.set("kiln/round/old/joined", "1")
    server.set("kiln/round/old/0/rank_0", "127.0.0.1:1 (dead)")
    got = {}

    def rank(r: int, delay: float):
        time.sleep(delay)
        got[r] = round_store(r, 2, timedelta(seconds=10))

    threads = [Thread(target=rank, args=(1, 0.0)), Thread(target=rank, args=(0, 0.5))]  # rank 1 reads "old" first
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    token = server.get("kiln/round/leader").decode()
    assert token != "old"
    got[0].set("0/rank_0", "new")
    assert got[1].get("0/rank_0") == b"new"  # one namespace for both ranks, the new round's
    assert server.get(f"kiln/round/{token}/0/rank_0") == b"new"
    with pytest.raises(TimeoutError, match=r"rank 1: the 2 workers of this torchrun round did not meet .* within "
                                           r"parallel.timeout=0.3 s \(rank 0 never acknowledged this rank\)"):
        round_store(1, 2, timedelta(seconds=0.3))  # no rank 0 this time


def test_a_resume_on_another_world_says_what_happens_to_the_batch():
    from kiln.parallel.elastic import batch_after_resharding
    from kiln.train.loop import TrainConfig

    kept = TrainConfig(micro_batch_size=4, grad_accum_steps=2, global_batch_size=8)  # resolved for 1 rank
    assert batch_after_resharding(2, 2, kept) is None
    assert batch_after_resharding(2, 1, kept) == ("resumed on 1 data-parallel rank, the checkpoint's world had 2: "
                                                  "grad_accum_steps 1 → 2 keeps train.global_batch_size=8")
    per_rank = TrainConfig(micro_batch_size=4, grad_accum_steps=1)
    assert batch_after_resharding(2, 1, per_rank) == (
        "resumed on 1 data-parallel rank, the checkpoint's world had 2: grad_accum_steps 1 kept "
        "(train.global_batch_size is not set), so a step takes 4 sequences, was 8; --train.global_batch_size=8 "
        "keeps it")
    assert batch_after_resharding(1, 2, per_rank).startswith("resumed on 2 data-parallel ranks, the checkpoint's "
                                                             "world had 1: grad_accum_steps 1 kept")


def test_tokens_seen_is_stored_global_and_old_checkpoints_are_read_with_their_world():
    from kiln.train.checkpoint import global_tokens_seen, saved_world

    new = {"tokens_seen": 2048, "world": {"size": 4, "dp": 2}, "data": {"world": 2}}
    assert global_tokens_seen(new) == 2048 and saved_world(new) == {"size": 4, "dp": 2}
    old = {"tokens_seen": 1024, "data": {"batches_served": 4, "world": 2}}  # one rank's count, 2 dp ranks
    assert global_tokens_seen(old) == 2048 and saved_world(old) == {"size": 2, "dp": 2}
    assert global_tokens_seen({"tokens_seen": 96}) == 96  # one process, no data state
