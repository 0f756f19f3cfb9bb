"""kiln.fit with the user's own tensor-parallel plan (`tensor_parallel=`) on a model kiln knows nothing of: 4 gloo
processes as tp2 × dp2 (in tests/parallel/tp_worker.py's launch) against the same model trained by fit() in one
process, at the same global batch (8) and seed, fp32, 6 steps, labels ignored unevenly across the dp ranks.

The plan (tests/parallel/scenarios.py megatron_mlp) splits the first linear column-wise and the second row-wise;
kiln replicates the LayerNorm it leaves whole. Every step's gradient norm is above the clip threshold (1.0), so
the losses after step 1 match only if the norm is the global one over the tp and dp shards. Tolerance 1e-5
relative, as in test_tensor_parallel.py: the sums in another order move the last bits (~1e-7 here). The same
holds after a resume at step 3, under tp2 × dp2 and in one process without the plan; a NaN injected on one rank
is traced and skipped on all four.

The refusals (a plan that splits nothing, one on another mesh, a module holding parameters beside split
submodules; fit()'s layout checks) run in this process: a world of one and a tp mesh of size 1.
"""
import json

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from kiln import FitInputError, fit
from kiln.parallel import ParallelConfig, init_world
from kiln.parallel.user_plan import apply_user_plan
from tests.parallel.scenarios import fit_data, fit_settings, fit_tp_run, megatron_mlp, rewound, user_mlp
from tests.parallel.test_dist import assert_close_weights, records

RTOL = 1e-5


@pytest.fixture(scope="module")
def fit_reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("fit-tp-single") / "fit"
    fit_tp_run("none", 1, run)
    return run


@pytest.mark.parametrize("run", ["fit_fsdp", "fit_ddp", "fit_resumed"])
def test_tp2_dp2_fit_trains_as_one_process(tp_launched, fit_reference, run):
    """fit_resumed: fit_fsdp's step-3 checkpoint continued with resume=True on the same layout to step 6."""
    if run == "fit_resumed":  # (its metrics.jsonl keeps steps 1-3 of fit_fsdp and the resumed 4-6)
        resumed = tp_launched / run / "checkpoints" / "step_000003"
        assert f"resumed from {resumed} at step 3" in (tp_launched / "tp_worker.py.log").read_text()
    got, want = records(tp_launched / run, "train"), records(fit_reference, "train")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    got = {r["step"]: r for r in got}
    for w in want:
        assert w["grad_norm"] > w["clip_threshold"] == 1.0
        for key in ("loss", "grad_norm"):
            assert got[w["step"]][key] == pytest.approx(w[key], rel=RTOL), (w["step"], key)
    assert_close_weights(tp_launched / run, fit_reference)  # the consolidated weights: full tensors
    (e,), (w,) = records(tp_launched / run, "eval")[-1:], records(fit_reference, "eval")[-1:]
    for key in ("val_loss", "val_acc"):  # evaluated over the dp copies, the metric's sums too
        assert e[key] == pytest.approx(w[key], rel=RTOL), key


def test_a_tp_checkpoint_resumes_in_one_process(tp_launched, fit_reference, tmp_path):
    """fit_fsdp's step-3 checkpoint continued by one process without the plan (DCP holds whole tensors by the
    model's own names): the straight curve."""
    run = rewound(tp_launched / "fit_fsdp", tmp_path / "resumed")
    fit_tp_run("ddp", 1, run, interval=3, resume=True)
    got, want = records(run, "train"), records(fit_reference, "train")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for g, w in zip(got[3:], want[3:]):
        assert g["loss"] == pytest.approx(w["loss"], rel=RTOL), w["step"]
    assert_close_weights(run, fit_reference)


def test_a_nan_under_the_users_plan_is_traced_and_skipped_everywhere(tp_launched):
    """A NaN in module 2's (the row-parallel linear's) output on rank 1 at step 4: the step is withheld on every
    rank, the report names the module, the run goes on to step 6."""
    run = tp_launched / "fit_nan"
    assert [e["step"] for e in records(run, "numerics") if e["event"] == "nonfinite"] == [4]
    report = json.loads((run / "nonfinite_report.json").read_text())
    assert (report["rank"], report["module"], report["step"]) == (1, "2", 4)
    train = records(run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and train[-1]["skipped_steps"] == 1


@pytest.mark.parametrize("run,dp_shards", [("fit_fsdp", 2), ("fit_ddp", 1)])
def test_the_layout_event_shows_the_users_split(tp_launched, run, dp_shards):
    """Each rank holds half of every split tensor (the row linear's bias is whole), all of the LayerNorm, and
    under FSDP2 half of that again."""
    (event,) = [e for e in records(tp_launched / run, "event") if e["event"] == "layout"]
    assert event["mesh"] == {"pp": 1, "dp": 2, "tp": 2} and event["strategy"] == run.removeprefix("fit_")
    params = dict(user_mlp().named_parameters())
    split = {"0.weight", "0.bias", "2.weight"}
    per_rank = 4 * sum(p.numel() // (2 if name in split else 1) for name, p in params.items()) // dp_shards
    assert event["param_bytes_per_rank"] == [per_rank] * 4
    assert event["param_bytes_unsharded"] == 4 * sum(p.numel() for p in params.values()) > per_rank


@pytest.mark.parametrize("settings,plan,message", [
    ({"parallel.tp": 2}, None, "parallel.tp=2 splits a model by a tensor-parallel plan, and kiln has none for "
                               "Sequential: pass tensor_parallel=fn(model, tp_mesh)"),
    ({}, megatron_mlp, "tensor_parallel= splits the model over parallel.tp ranks, and parallel.tp=1: set "
                       "parallel.tp"),
    ({"parallel.tp": 2}, "0", "tensor_parallel='0' is not callable"),
    ({"parallel.tp": 2, "parallel.sequence_parallel": True}, megatron_mlp,
     "parallel.sequence_parallel is kiln's plan for its Transformer"),
    ({"parallel.pp": 2}, None, "parallel.pp=2: fit() does not split a model of your own into pipeline stages"),
])
def test_fit_refuses_a_layout_it_cannot_apply(tmp_path, settings, plan, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fit(user_mlp(), fit_data(), config=fit_settings("none", **settings), run_dir=tmp_path,
            tensor_parallel=plan)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_tensor_parallel_error_names_the_argument(tmp_path):
    with pytest.raises(FitInputError) as e:
        fit(user_mlp(), fit_data(), config=fit_settings("none", **{"parallel.tp": 2}), run_dir=tmp_path)
    assert e.value.argument == "tensor_parallel"


class Scaled(nn.Module):
    """A module with a parameter of its own beside a submodule that a plan splits."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.fixture(scope="module")
def tp_mesh():
    init_world(ParallelConfig(strategy="ddp"), "cpu")  # a world of one: the process group a mesh needs
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))


def colwise(path):
    def plan(model, mesh):
        parallelize_module(model, mesh, {path: ColwiseParallel()})
    return plan


@pytest.mark.parametrize("model,plan,mesh_dim,message", [
    (user_mlp, lambda model, mesh: None, "tp", "tensor_parallel=<lambda> split no parameter of Sequential: apply "
                                               "your plan with parallelize_module"),
    (user_mlp, colwise("0"), "dp", r"tensor_parallel=plan put 0.weight on a mesh of dims \('dp',\), not the tp "
                                   r"mesh it was given"),
    (Scaled, colwise("lin"), "tp", r"the model \(Scaled\) holds scale itself and has split submodules"),
])
def test_a_plan_kiln_cannot_complete_is_refused(tp_mesh, model, plan, mesh_dim, message):
    """The tp mesh kiln hands the plan is tp_mesh["tp"]; the second plan is applied on the dp dim instead."""
    wrong = tp_mesh[mesh_dim]

    def applied(m, mesh):
        plan(m, wrong)

    applied.__name__ = plan.__name__
    with pytest.raises(ValueError, match=message):
        apply_user_plan(model(), tp_mesh["tp"], applied)


def test_what_the_plan_leaves_whole_is_replicated_on_the_tp_mesh(tp_mesh):
    model = user_mlp()
    want = model(fit_data().tensors[0][:8])
    apply_user_plan(model, tp_mesh["tp"], megatron_mlp)
    for name, p in model.named_parameters():
        assert p.device_mesh == tp_mesh["tp"], name
        assert p.placements[0].is_replicate() == name.startswith(("2.bias", "3.")), name
    torch.testing.assert_close(model(fit_data().tensors[0][:8]), want)  # a tp mesh of 1: the same function
