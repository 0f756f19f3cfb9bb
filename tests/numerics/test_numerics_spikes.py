"""Spike detection (rolling median/MAD on the device) and the four policies end to end."""
import json

import numpy as np
import pytest
import torch

from kiln.numerics.spikes import GN_Z, LOSS_MAD, LOSS_MED, LOSS_Z, SPIKE, StepGuard
from kiln.run.lm import build_lm, train

CPU = torch.device("cpu")


def _guard(withhold=True, window=30, min_history=10, ring=64):
    return StepGuard(window, min_history, threshold=6.0, rel_floor=0.01, withhold=withhold, ring_size=ring,
                     device=CPU)


def _feed(guard, losses, norms):
    skips = []
    for step, (loss, gn) in enumerate(zip(losses, norms), start=1):
        guard.step = step
        skip = guard.check(torch.tensor(loss), torch.tensor(gn), torch.tensor(0.0), torch.tensor(1.0))
        skips.append(skip.item())
    return skips


def _lower_median(a):
    """torch's median: for an even count, the lower of the two middle values (numpy averages them)."""
    return np.sort(a)[(len(a) - 1) // 2]


def test_detector_matches_a_numpy_reference_and_flags_only_the_spike():
    rng = np.random.default_rng(0)
    n = 50
    losses = 3.0 + 0.05 * rng.standard_normal(n)
    norms = 1.0 + 0.1 * rng.standard_normal(n)
    losses[35] = 4.0  # 20 sigma above
    guard = _guard()
    skips = _feed(guard, losses, norms)
    assert [i + 1 for i, s in enumerate(skips) if s] == [36]
    # Reference: the level is the median of the last 10 accepted steps; the noise the MAD of the step-to-step
    # changes over the last 30 steps (the spike itself never enters the history, so no change next to it counts).
    accepted = losses.copy()
    accepted[35] = np.nan
    for step in (20, 36, 45):
        window = accepted[max(0, step - 1 - 30):step - 1]
        recent = window[-10:]
        level = _lower_median(recent[~np.isnan(recent)])
        diffs = np.diff(window)
        diffs = diffs[~np.isnan(diffs)]
        mad = _lower_median(np.abs(diffs - _lower_median(diffs)))
        row = guard.ring[guard.slot(step)].tolist()
        assert row[LOSS_MED] == pytest.approx(level, rel=1e-5)
        assert row[LOSS_MAD] == pytest.approx(mad, rel=1e-4)
        spread = max(1.4826 * mad / 2 ** 0.5, 0.01 * level)
        assert row[LOSS_Z] == pytest.approx((losses[step - 1] - level) / spread, rel=1e-4)


def _early_training(seed, n=80):
    """A loss falling fast from 5.5 towards 2.5 with the noise of small first batches (σ 0.15 before step 30, 0.05
    after) and a gradient norm falling from ~11 with 20% multiplicative noise: the shape of the default job's
    first 80 steps."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1)
    loss = 2.5 + 3.0 * np.exp(-t / 10) + np.where(t < 30, 0.15, 0.05) * rng.standard_normal(n)
    norm = (1.5 + 10 * np.exp(-t / 5)) * np.exp(0.2 * rng.standard_normal(n))
    return loss, norm


def test_early_training_noise_is_not_a_spike():
    for seed in range(20):
        loss, norm = _early_training(seed)
        guard = _guard(window=100, min_history=20, ring=128)
        assert not any(_feed(guard, loss, norm)), seed


@pytest.mark.parametrize("at", [22, 30, 45, 70])
def test_a_loss_that_doubles_in_one_step_is_a_spike_early_on(at):
    """While the loss is still falling fast, the median and MAD of the whole window sat far above the current loss:
    a doubling at step 22-40 reached z 3-4.4 against the threshold of 6 and was missed."""
    for seed in range(5):
        loss, norm = _early_training(seed)
        loss[at - 1] *= 2
        guard = _guard(window=100, min_history=20, ring=128)
        assert [i + 1 for i, s in enumerate(_feed(guard, loss, norm)) if s] == [at], seed
        assert guard.ring[guard.slot(at)][LOSS_Z].item() > 10


def test_detector_waits_for_history_ignores_drops_and_can_judge_grad_norm_alone():
    guard = _guard()
    losses = [5.0, 4.5, 4.0, 3.8, 3.6, 3.5, 3.4, 3.3, 3.25, 3.2, 3.15, 3.1, 1.0, 3.05, 3.0]  # a drop is not a spike
    norms = [1.0] * len(losses)
    norms[1] = 50.0  # before min_history accepted steps: not judged
    assert not any(_feed(guard, losses, norms))
    guard = _guard()
    norms = list(1.0 + 0.05 * np.random.default_rng(1).standard_normal(20))
    norms[15] = 10.0
    skips = _feed(guard, [3.0] * 20, norms)
    assert [i + 1 for i, s in enumerate(skips) if s] == [16]
    assert guard.ring[guard.slot(16)][GN_Z].item() > 12  # judged against the grad-norm threshold


def test_warn_records_but_never_withholds():
    guard = _guard(withhold=False)
    losses = [3.0 + 0.01 * (i % 3) for i in range(20)]
    losses[15] = 9.0
    assert not any(_feed(guard, losses, [1.0] * 20))
    assert guard.ring[guard.slot(16)][SPIKE].item() == 1.0


# ------------------------------------------------------------------------------------------- end to end

STEPS, SPIKE_AT = 40, 25


def _run(small_config, tmp_path, name, policy, spike=0, steps=STEPS, resume=False, **numerics):
    cfg = small_config(train={"max_steps": steps}, optim={"lr": 3e-3}, log={"interval": 5},
                       numerics={"spike_policy": policy, "snapshot_interval": 5, **numerics},
                       faults={"spike": spike})
    return train(cfg, tmp_path / name, resume=resume)


def _events(run_dir, kind):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == kind]


def _adam_steps(summary):
    return max(int(s["step"]) for s in summary.state.optimizer.state.values())




_clean: dict = {}  # one clean run shared by the tests of this module


def _clean_run(small_config, tmp_path_factory):
    if not _clean:
        path = tmp_path_factory.mktemp("clean")
        _clean.update(result=_run(small_config, path, "run", "rollback"), dir=path / "run")  # armed, snapshotting
    return _clean


def test_armed_detection_does_not_change_a_clean_run(small_config, tmp_path, tmp_path_factory):
    shared = _clean_run(small_config, tmp_path_factory)
    armed = shared["result"]
    off = _run(small_config, tmp_path, "off", "off", trace=False)
    assert not _events(shared["dir"], "loss_spike")
    a, b = off.state.model.state_dict(), armed.state.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert off.val_loss == armed.val_loss


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_spike_is_survived(small_config, tmp_path, tmp_path_factory, policy):
    clean = _clean_run(small_config, tmp_path_factory)["result"]
    hit = _run(small_config, tmp_path, "hit", policy, spike=SPIKE_AT)
    spikes = _events(tmp_path / "hit", "loss_spike")
    assert [s["step"] for s in spikes] == [SPIKE_AT] and spikes[0]["stats"]["loss_z"] > 6
    assert hit.step == STEPS and hit.stop_reason == "max_steps"
    assert abs(hit.val_loss - clean.val_loss) / clean.val_loss < 0.02
    if policy == "skip":
        assert _adam_steps(hit) == STEPS - 1  # the spike's update alone was withheld
    else:
        rollback, = _events(tmp_path / "hit", "rollback")
        assert (rollback["to_step"], rollback["skipped_batches"]) == (20, 5)  # snapshot at 20, batches 21-25 dropped
        assert _adam_steps(hit) == STEPS  # steps 21-40 re-run from the restored state


def test_warn_applies_the_spike(small_config, tmp_path):
    hit = _run(small_config, tmp_path, "hit", "warn", spike=SPIKE_AT)
    assert [s["action"] for s in _events(tmp_path / "hit", "loss_spike")] == ["update applied"]
    assert _adam_steps(hit) == STEPS


def test_stop_ends_cleanly_with_a_checkpoint_that_resumes(small_config, tmp_path):
    stopped = _run(small_config, tmp_path, "run", "stop", spike=SPIKE_AT)
    assert stopped.step == SPIKE_AT  # the sync point right after the spike (log interval 5)
    assert stopped.stop_reason.startswith(f"numerics: loss spike at step {SPIKE_AT}")
    assert "--resume" in stopped.stop_reason
    assert (tmp_path / "run" / "checkpoints" / f"step_{SPIKE_AT:06d}" / "state.pt").exists()
    assert _events(tmp_path / "run", "stop")[0]["reason"] == stopped.stop_reason
    resumed = _run(small_config, tmp_path, "run", "stop", spike=SPIKE_AT, resume=True)
    assert resumed.step == STEPS and resumed.stop_reason == "max_steps"
    assert len(_events(tmp_path / "run", "loss_spike")) == 1  # the spike's batch is behind the saved position


def test_rollback_from_disk_with_an_lr_cut(small_config, tmp_path):
    from kiln.train.schedule import lr_factor

    cfg = small_config(train={"max_steps": 30}, optim={"lr": 3e-3}, log={"interval": 1},
                       checkpoint={"interval": 5},
                       numerics={"spike_policy": "rollback", "rollback_from": "disk", "rollback_lr_factor": 0.5,
                                 "rollback_lr_steps": 3},
                       faults={"spike": SPIKE_AT})
    summary = train(cfg, tmp_path / "run")
    rollback, = _events(tmp_path / "run", "rollback")
    assert (rollback["to_step"], rollback["skipped_batches"]) == (20, 5)
    assert rollback["source"].endswith("step_000020")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}  # the last record of a step wins: after the rollback
    for step in range(21, 26):
        scheduled = 3e-3 * lr_factor(cfg.schedule, step - 1, 30)
        assert lr[step] == pytest.approx(scheduled * (0.5 if step <= 23 else 1.0)), step
    assert summary.step == 30


def test_rollback_to_the_initial_snapshot(small_config, tmp_path):
    hit = _run(small_config, tmp_path, "hit", "rollback", spike=SPIKE_AT, snapshot_interval=1000)
    assert [s["step"] for s in _events(tmp_path / "hit", "loss_spike")] == [SPIKE_AT]
    assert [(r["to_step"], r["skipped_batches"]) for r in _events(tmp_path / "hit", "rollback")] == [(0, SPIKE_AT)]
    assert hit.step == STEPS


class _Quiet:
    def log(self, record, kind):
        pass

    def print(self, *args, **kw):
        pass


def test_rollback_restores_the_spike_history_with_the_weights(small_config, tmp_path):
    """After a rollback, steps are judged against the statistics of the restored weights, not of later ones.

    (Without this, a rollback far back once judged early-training gradient norms against late-training
    statistics and flagged them as spikes: two false rollbacks in a row while this was built.)
    """
    cfg = small_config(numerics={"spike_policy": "rollback"})
    lm = build_lm(cfg, tmp_path / "run", log=lambda msg: None)
    trainer = lm.trainer(tmp_path / "run")
    run, numerics = lm.state, trainer.numerics
    numerics.start()  # snapshot of step 0: empty history
    try:
        guard = numerics.guard
        for step in range(1, 6):
            numerics.begin_step(step, [run.loader.next()])
            guard.check(torch.tensor(3.0), torch.tensor(1.0), torch.tensor(0.0), torch.tensor(1.0))
        run.step = 5
        assert int((~guard.history[0].isnan()).sum()) == 5
        assert numerics._rollback(5, _Quiet())
        assert run.step == 0 and bool(guard.history.isnan().all())
        assert run.loader.batches_served == 5  # the five batches of steps 1-5 are skipped
    finally:
        numerics.close()
        run.loader.close()


def test_resume_inside_an_lr_cut_continues_on_the_same_curve(small_config, tmp_path):
    """The numerics state is in the checkpoint: a run resumed while a rollback's lr cut is in force (and with its
    spike history) trains exactly as the run that never stopped."""
    def cfg(steps):
        return small_config(train={"max_steps": steps}, optim={"lr": 3e-3}, log={"interval": 5},
                            schedule={"total_steps": STEPS}, checkpoint={"interval": 30},
                            numerics={"spike_policy": "rollback", "snapshot_interval": 5, "rollback_lr_factor": 0.5,
                                      "rollback_lr_steps": 15},
                            faults={"spike": SPIKE_AT})

    straight = train(cfg(STEPS), tmp_path / "straight")
    rollbacks = _events(tmp_path / "straight", "rollback")
    assert [(r["step"], r["to_step"]) for r in rollbacks] == [(SPIKE_AT, 20)]  # lr halved for steps 21-35
    train(cfg(30), tmp_path / "resumed")  # stops at step 30, inside the cut
    resumed = train(cfg(STEPS), tmp_path / "resumed", resume=True)

    def curve(run_dir):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["lr"]) for r in records if r["kind"] == "train"}

    a, b = curve(tmp_path / "straight"), curve(tmp_path / "resumed")
    assert {s: a[s] for s in (35, 40)} == {s: b[s] for s in (35, 40)}
    assert b[35][1] < 3e-3 * 0.5 + 1e-12  # the cut was still in force after the resume
    for key, value in straight.state.model.state_dict().items():
        assert torch.equal(value, resumed.state.model.state_dict()[key]), key
    history = straight.state.numerics.state_dict(), resumed.state.numerics.state_dict()
    assert torch.allclose(history[0]["spike_history"], history[1]["spike_history"], rtol=0, atol=0, equal_nan=True)
    assert history[0]["lr_until"] == history[1]["lr_until"] == 20 + 15
