"""kiln as a library: fit() on models of the user's own, with each loss; resume, accumulation, NaN tracing, BatchNorm."""
import io
import json
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from torch.utils.data import Dataset, TensorDataset

from kiln import fit
from kiln.train.losses import MSE
from kiln.train.objective import Supervised
from kiln.train.precision import LossScaler, Precision, PrecisionConfig
from kiln.train.step import accumulate_gradients

CPU = torch.device("cpu")
BASE = {"train.micro_batch_size": 8, "train.grad_accum_steps": 2, "schedule.warmup_steps": 2, "optim.lr": 1e-2,
        "log.interval": 1, "log.tensorboard": False, "log.progress": "off", "train.device": "cpu",
        "precision.mode": "fp32"}


class MLP(nn.Module):
    def __init__(self, d_in=6, d_out=3, dropout=0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, d_out))

    def forward(self, x):
        return self.body(x)


class Pairs(Dataset):
    """Two noisy views of the same random point: a contrastive toy."""

    def __init__(self, n=60):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 6, generator=g)
        self.noise = 0.1 * torch.randn(2, n, 6, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + self.noise[0, i], self.x[i] + self.noise[1, i]


def _data(loss):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(61, 6, generator=g)  # 61: the last batch of every epoch is uneven
    w = torch.randn(6, 3, generator=g)
    if loss == "ntxent":
        return Pairs()
    if loss == "cross_entropy":
        return TensorDataset(x, (x @ w).argmax(-1))
    if loss == "bce":
        return TensorDataset(x, ((x @ w) > 0).float())
    return TensorDataset(x, x @ w)


LOSSES = {"cross_entropy": "cross_entropy", "mse": "mse", "huber": "huber", "bce": "bce", "ntxent": "ntxent",
          "callable": lambda out, y: F.l1_loss(out, y)}


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_user_model_trains_and_resumes_bit_identically(name, tmp_path):
    data = _data("ntxent" if name == "ntxent" else name if name != "callable" else "mse")
    steps = 12
    config = BASE | {"train.max_steps": steps, "schedule.total_steps": steps}

    torch.manual_seed(0)
    straight = fit(MLP(), data, loss=LOSSES[name], config=config, run_dir=tmp_path / "straight")
    torch.manual_seed(0)
    fit(MLP(), data, loss=LOSSES[name], config=config | {"train.max_steps": steps // 2}, run_dir=tmp_path / "resumed")
    torch.manual_seed(1)  # a different init: everything must come from the checkpoint
    resumed = fit(MLP(), data, loss=LOSSES[name], config=config, run_dir=tmp_path / "resumed", resume=True)

    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert a == b and len(a) == steps
    # one process writes the layout record every torchrun run writes, its bytes those of MLP()'s fp32 parameters
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    whole = 4 * sum(p.numel() for p in MLP().parameters())
    assert [r for r in records if r.get("event") == "layout"] == [
        {"kind": "event", "step": 0, "event": "layout", "mesh": {"dp": 1}, "strategy": "none",
         "sequence_parallel": False, "param_bytes_per_rank": [whole], "param_bytes_unsharded": whole}]
    assert a[steps] < a[1]  # it learned something
    for key, value in straight.state.model.state_dict().items():
        assert torch.equal(value, resumed.state.model.state_dict()[key]), key
    # 24 batches of 8 are three epochs of 8 batches, the last of each uneven (61 = 7·8 + 5; 60 = 7·8 + 4)
    assert straight.state.tokens_seen == resumed.state.tokens_seen == 3 * len(data)


def test_accumulation_equals_one_big_batch_in_float64_with_an_uneven_last_micro_batch():
    torch.manual_seed(0)
    model = MLP(dropout=0.0).double()
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    objective, precision = Supervised(MSE()), Precision("fp64", CPU)
    scaler = LossScaler(PrecisionConfig(), CPU, enabled=False)
    loss_big, n_big = accumulate_gradients(model, [(x, y)], objective, precision, scaler)
    big = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    micro = [(x[:3], y[:3]), (x[3:6], y[3:6]), (x[6:], y[6:])]
    loss_acc, n_acc = accumulate_gradients(model, micro, objective, precision, scaler)
    assert n_big.item() == n_acc.item() == 7
    assert loss_acc.item() == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-12)
    assert loss_acc.item() == pytest.approx(loss_big.item(), rel=1e-12)
    for g, p in zip(big, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)


def test_nan_trace_names_a_module_of_the_user_model(tmp_path):
    config = BASE | {"train.max_steps": 6, "faults.nan_forward": "body.1@4", "numerics.trace": True}
    result = fit(MLP(), _data("mse"), loss="mse", config=config, run_dir=tmp_path / "run")
    report = json.loads((tmp_path / "run" / "nonfinite_report.json").read_text())
    assert report["module"] == "body.1" and report["phase"] == "forward" and report["step"] == 4
    assert result.step == 6  # the NaN step was withheld, the run went on


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def test_batchnorm_sees_micro_batches_not_the_global_batch():
    """Documented (docs/training.md): under accumulation BatchNorm normalises each micro-batch by its own
    statistics and updates its running statistics once per micro-batch, so k micro-batches of B are not one batch
    of kB for a model with BatchNorm, as they are for every per-sample loss without it."""
    torch.manual_seed(0)
    model = BNNet().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    objective, precision = Supervised(MSE()), Precision("fp64", CPU)
    scaler = LossScaler(PrecisionConfig(), CPU, enabled=False)
    accumulate_gradients(model, [(x, y)], objective, precision, scaler)
    big = [p.grad.clone() for p in model.parameters()]
    assert model.bn.num_batches_tracked.item() == 1
    model.zero_grad()
    accumulate_gradients(model, [(x[:4], y[:4]), (x[4:], y[4:])], objective, precision, scaler)
    assert model.bn.num_batches_tracked.item() == 3  # one update per micro-batch
    assert not torch.allclose(model.fc.weight.grad, big[0], rtol=1e-6)  # statistics of 4 samples, not of 8


def test_levers_that_need_transformer_blocks_say_so(tmp_path):
    with pytest.raises(ValueError, match="blocks.*memory.recompute=none"):
        fit(MLP(), _data("mse"), loss="mse", config=BASE | {"memory.recompute": "full"}, run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="memory.chunked_loss=0"):
        fit(MLP(), _data("mse"), loss="mse", config=BASE | {"memory.chunked_loss": 64}, run_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="memory.offload_blocks=none"):
        fit(MLP(), _data("mse"), loss="mse", config=BASE | {"memory.offload_blocks": "all"}, run_dir=tmp_path / "c")


@pytest.mark.parametrize("mode", ["bf16-master", "fp64"])
def test_inputs_follow_the_weights_dtype(mode, tmp_path):
    """bf16-master and fp64 keep the weights in bf16 / fp64: float inputs are cast to match, targets are not."""
    result = fit(MLP(), _data("mse"), loss="mse", eval_data=_data("mse"),
                 config=BASE | {"train.max_steps": 3, "precision.mode": mode}, run_dir=tmp_path / "run")
    assert next(result.state.model.parameters()).dtype == {"bf16-master": torch.bfloat16, "fp64": torch.float64}[mode]
    assert result.val_loss is not None and result.val_loss == result.val_loss  # finite, not NaN


def test_batches_from_an_iterable_and_a_one_shot_iterator(tmp_path):
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]  # re-iterable: epochs repeat it
    result = fit(MLP(), batches, loss="mse", config=BASE | {"train.max_steps": 5}, run_dir=tmp_path / "list")
    assert result.step == 5 and result.state.loader.batches_served == 10
    with pytest.raises(ValueError, match="ran out after 4 batches"):
        fit(MLP(), iter(batches), loss="mse", config=BASE | {"train.max_steps": 5}, run_dir=tmp_path / "once")


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(TypeError, match="torch Dataset"):
        fit(MLP(), 42, loss="mse", config=BASE, run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="mse"):
        fit(MLP(), _data("mse"), loss="mean_squared", config=BASE, run_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="unknown config key optim.learning_rate"):
        fit(MLP(), _data("mse"), loss="mse", config={"optim.learning_rate": 1e-3}, run_dir=tmp_path / "c")


# -- epochs, callbacks, metrics, predict: against a plain PyTorch loop on the same seed ----------------------------

# float64 and plain SGD at a constant lr: the reference loop below is the same arithmetic, so everything but the
# order of a few float64 sums is shared and the weights agree to ~1e-15
PLAIN = BASE | {"train.grad_accum_steps": 1, "precision.mode": "fp64", "optim.name": "sgd", "optim.momentum": 0.0,
                "optim.lr": 0.05, "optim.weight_decay": 0.0, "optim.grad_clip": 0.0, "schedule.name": "constant",
                "schedule.warmup_steps": 0, "numerics.spike_policy": "off"}
SEED = 1337  # train.seed's default


def _plain_loop(model, data, steps, batch_size=8):
    """What fit() documents, written out: seed torch, batches of kiln's seeded permutation per epoch (the last one
    uneven), mean loss, backward, SGD step. Dropout draws from torch's RNG in the same order."""
    import numpy as np
    torch.manual_seed(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, step, epoch = [], 0, 0
    while step < steps:
        order = np.random.default_rng([SEED, epoch]).permutation(len(data))
        for i in range(0, len(data), batch_size):
            if step == steps:
                break
            x, y = data[torch.as_tensor(order[i:i + batch_size])]
            loss = F.mse_loss(model(x.double()), y.double())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
        epoch += 1
    return losses


class Recorder:
    """A callback that keeps what it is given and stops the run at a chosen step."""

    def __init__(self, stop_at=None):
        self.steps, self.evals, self.checkpoints, self.stop_at = [], [], [], stop_at

    def on_step_end(self, trainer, record):
        self.steps.append(record)
        if record["step"] == self.stop_at:
            trainer.request_stop(f"callback: stop at {self.stop_at}")

    def on_eval(self, trainer, record):
        self.evals.append(record)

    def on_checkpoint(self, trainer, path):
        self.checkpoints.append(path)


def test_epochs_and_callbacks_match_a_plain_pytorch_loop(tmp_path):
    data = _data("mse")  # 61 samples: 8 micro-batches of 8 per epoch, the last of 5
    torch.manual_seed(0)
    model = MLP().double()
    reference = MLP().double()
    reference.load_state_dict(model.state_dict())
    plain = _plain_loop(reference, data, steps=16)

    recorder = Recorder()
    result = fit(model, data, loss="mse", epochs=2, callbacks=[recorder], config=PLAIN, run_dir=tmp_path / "two")
    assert result.step == 16 and result.stop_reason == "max_steps" and result.state.tokens_seen == 2 * len(data)
    assert [r["step"] for r in recorder.steps] == list(range(1, 17))
    assert [r["loss"] for r in recorder.steps] == pytest.approx(plain, rel=1e-12)
    assert _losses(tmp_path / "two") == {s + 1: pytest.approx(v, rel=1e-12) for s, v in enumerate(plain)}
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(result.state.model.state_dict()[key], value, rtol=1e-12, atol=1e-14)
    assert recorder.checkpoints == [result.checkpoint]  # the final one (checkpoint.interval=0)

    # no max_steps, data with a length: one epoch, not the language model's time budget
    torch.manual_seed(0)
    one = fit(MLP().double(), data, loss="mse", config=PLAIN, run_dir=tmp_path / "one")
    assert one.step == 8 and _losses(tmp_path / "one") == {s + 1: pytest.approx(v, rel=1e-12)
                                                          for s, v in enumerate(plain[:8])}


def test_a_callback_ends_the_run_with_its_reason_and_sees_evals_and_checkpoints(tmp_path):
    data = _data("mse")
    torch.manual_seed(0)
    model = MLP().double()
    reference = MLP().double()
    reference.load_state_dict(model.state_dict())
    plain = _plain_loop(reference, data, steps=5)
    recorder = Recorder(stop_at=5)
    result = fit(model, data, loss="mse", eval_data=_data("mse"), epochs=3, callbacks=[recorder],
                 config=PLAIN | {"log.interval": 2, "train.eval_interval": 2, "checkpoint.interval": 4},
                 run_dir=tmp_path / "run")
    assert result.step == 5 and result.stop_reason == "callback: stop at 5"
    # logged steps carry the train record, the others step and lr only
    assert [sorted(r) for r in recorder.steps[:2]] == [["lr", "step"], sorted(_logged_keys(tmp_path / "run"))]
    assert recorder.steps[1]["loss"] == pytest.approx(plain[1], rel=1e-12)
    assert [r["step"] for r in recorder.evals] == [2, 4]
    assert [p.name for p in recorder.checkpoints] == ["step_000004", "step_000005"]
    assert result.checkpoint == recorder.checkpoints[-1]
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(result.state.model.state_dict()[key], value, rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match=r"callbacks\[0\] \(int\) has none of on_step_end, on_eval, on_checkpoint"):
        fit(MLP(), data, loss="mse", callbacks=[3], config=BASE, run_dir=tmp_path / "bad")


def _logged_keys(run_dir):
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    first = next(r for r in records if r["kind"] == "train")  # after the run's layout record
    return [k for k in first if k != "kind"]


def test_metrics_over_the_whole_validation_set_are_logged_and_charted(tmp_path):
    from kiln.report.figures import build_charts
    from kiln.report.runs import read_run

    train, val = _data("cross_entropy"), _data("cross_entropy")  # 61 validation samples: last batch of 5
    x, y = val.tensors

    def acc(out, target):  # a float: the batch's mean, weighted by its size
        return (out.argmax(-1) == target).double().mean().item()

    def hits(out, target):  # a (sum, count) pair
        return (out.argmax(-1) == target).sum(), len(target)

    result = fit(MLP(), train, loss="cross_entropy", eval_data=val, metrics={"acc": acc, "hits": hits},
                 config=BASE | {"train.max_steps": 6, "train.eval_interval": 3}, run_dir=tmp_path / "run")
    model = result.state.model.eval()
    with torch.no_grad():
        out = model(x)
    expected_acc = (out.argmax(-1) == y).double().mean().item()
    assert result.val_metrics["val_acc"] == pytest.approx(expected_acc, abs=1e-12)
    assert result.val_metrics["val_hits"] == pytest.approx(expected_acc, abs=1e-12)
    assert result.val_loss == pytest.approx(F.cross_entropy(out.double(), y).item(), rel=1e-6)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert [e["step"] for e in evals] == [3, 6] and all({"val_acc", "val_hits"} <= set(e) for e in evals)
    assert evals[-1]["val_acc"] == result.val_metrics["val_acc"]
    charts = {c.key: c for c in build_charts([read_run(tmp_path / "run")], [None])}
    assert charts["eval_val_acc"].lines[0].y == [e["val_acc"] for e in evals]
    assert repr(result) == (f"TrainResult(step=6, stop_reason='max_steps', val_loss={result.val_loss:.4g}, "
                            f"val_acc={expected_acc:.4g}, val_hits={expected_acc:.4g}, "
                            f"checkpoint='{result.checkpoint}')")

    with pytest.raises(ValueError, match=r"metrics\['acc'\] returned a value of shape \(8,\); return one number"):
        fit(MLP(), train, loss="cross_entropy", eval_data=val, metrics={"acc": lambda o, t: o.argmax(-1) == t},
            config=BASE | {"train.max_steps": 1}, run_dir=tmp_path / "bad")
    with pytest.raises(ValueError, match="are computed on eval_data, and none was given"):
        fit(MLP(), train, loss="cross_entropy", metrics={"acc": acc}, config=BASE, run_dir=tmp_path / "bad2")


def test_predict_is_the_models_outputs_in_eval_mode_in_the_runs_precision(tmp_path):
    from kiln import predict

    data = _data("mse")
    x = data.tensors[0]
    result = fit(MLP(), data, loss="mse", config=BASE | {"train.max_steps": 2, "precision.mode": "fp64"},
                 run_dir=tmp_path / "fp64")
    model = result.state.model
    with torch.no_grad():
        expected = model.eval()(x.double())
    model.train()
    for given in (x, data, [(x[:30], None), (x[30:], None)]):
        got = predict(model, given, batch_size=7)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-15)  # the batching changes sums' order only
    assert model.training  # its mode is put back
    assert predict(model, x).shape == (61, 3)

    # an autocast run: bf16 outputs, as the run computed them
    bf16 = fit(MLP(), data, loss="mse", config=BASE | {"train.max_steps": 1, "precision.mode": "bf16"},
               run_dir=tmp_path / "bf16")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = bf16.state.model.eval()(x)
    assert torch.equal(predict(bf16.state.model, x, batch_size=61), expected)
    # a module fit() never saw: its own dtype and device, no autocast
    plain = MLP(dropout=0.0)
    torch.testing.assert_close(predict(plain, data), plain(x).detach(), rtol=1e-6, atol=1e-7)


# -- bad input: one line naming what was given, what is expected, and the fix --------------------------------------

class _Items(Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return self.item(i)


class _DictObjective:
    unit = "samples"

    def count(self, batch):
        return torch.tensor(batch[1].shape[0])

    def size(self, batch):
        return batch[0].shape[0]

    def __call__(self, model, batch):
        return ((model(batch[0]) - batch[1]) ** 2).sum()


X, Y = torch.randn(40, 6), torch.randn(40)
BAD = {
    "per-sample loss": (dict(train_data=TensorDataset(X, Y[:, None]),
                             loss=lambda o, t: F.mse_loss(o, t, reduction="none")),
                        r"the loss function returned a tensor of shape \(8, 1\) \(one value per sample\?\) for a "
                        r"batch of 8; fit\(\) needs the batch's mean, a scalar: return loss.mean\(\)"),
    "broadcast callable": (dict(train_data=TensorDataset(X, Y), loss=F.mse_loss),
                           r"model output \(8, 1\) and targets \(8,\) broadcast to \(8, 8\) in the loss, comparing "
                           r"every output with every target; make them the same shape \(e.g. return "
                           r"out.squeeze\(-1\) from forward, or targets \(8, 1\)\)"),
    "broadcast mse": (dict(train_data=TensorDataset(X, Y), loss="mse"), r"broadcast to \(8, 8\) in the loss"),
    "broadcast targets": (dict(train_data=TensorDataset(X, Y[:, None, None]), loss="huber"),
                          r"model output \(8, 1\) and targets \(8, 1, 1\) broadcast to \(8, 8, 1\) in the loss, "
                          r"comparing every output with every target; make them the same shape \(e.g. "
                          r"targets.squeeze\(-1\) in the data, or outputs \(8, 1, 1\)\)"),
    "strings": (dict(train_data=_Items(lambda i: (torch.randn(6), "cat"))),
                r"train_data\[0\] is \(Tensor\(6\), str\): kiln batches tensors, numbers and numpy arrays \(in "
                r"tuples, lists or dicts\), not str; turn it into a tensor in __getitem__"),
    "ragged": (dict(train_data=_Items(lambda i: (torch.randn(6 + i % 2), torch.tensor(1.0)))),
               r"train_data\[0:8\] cannot be stacked into a batch \(stack expects each tensor to be equal size.*"
               r"every item must have the same structure and tensor shapes"),
    "bare tensor": (dict(train_data=X), r"train_data is a bare Tensor of shape \(40, 6\); fit\(\) takes a Dataset "
                                        r"of \(inputs, targets\): pass TensorDataset\(inputs, targets\)"),
    "dict batches": (dict(train_data=_Items(lambda i: {"x": torch.randn(6), "y": torch.randn(1)})),
                     r"train_data's batches are dicts \(x, y\), and loss= takes \(inputs, targets\) pairs; return a "
                     r"tuple from __getitem__, or pass an objective that reads the dict"),
    "dict batches, tuple objective": (
        dict(train_data=_Items(lambda i: {"x": torch.randn(6), "y": torch.randn(1)}), loss=_DictObjective()),
        r"_DictObjective indexed train_data's batch with \[0\], but batches are dicts \(x, y\): index them by "
        r"key, batch\['x'\]"),
    "inputs only": (dict(train_data=TensorDataset(X)),
                    r"train_data's batches are \[Tensor\(8, 6\)\], and loss= takes \(inputs, targets\) pairs"),
    "eval strings": (dict(train_data=TensorDataset(X, Y[:, None]), eval_data=_Items(lambda i: ("a", "b"))),
                     r"eval_data\[0\] is \(str, str\)"),
    "class id out of range": (dict(train_data=TensorDataset(X, torch.arange(40) % 3), loss="cross_entropy"),
                              "^" + re.escape("train_data[0:8] holds class id 2 in its targets, and the model "
                                              "outputs 1 class score per sample (ids 0 to 0); give the model's last "
                                              "layer one output per class, or fix the labels (class ids run from 0 "
                                              "to the number of classes - 1; -100 marks a target to skip)") + "$"),
    "negative class id in a batch": (dict(train_data=[(X[:8], torch.full((8,), -3))], loss="cross_entropy"),
                                     r"^train_data's first batch holds class id -3 in its targets"),
    "epochs and max_steps": (dict(train_data=TensorDataset(X, Y[:, None]), epochs=2, config={"train.max_steps": 5}),
                             r"epochs=2 and train.max_steps=5 both set the run's length; pass one of them"),
    "epochs of an iterator": (dict(train_data=iter([(X, Y[:, None])]), epochs=2),
                              r"epochs=2 needs training data with a length \(a Dataset, a list, a DataLoader\); "
                              r"list_iterator has none: set train.max_steps instead"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_one_line_naming_the_fix(case, tmp_path):
    from kiln import FitInputError

    kwargs, message = BAD[case]
    kwargs = {"loss": "mse"} | kwargs
    kwargs["config"] = BASE | kwargs.get("config", {})
    with pytest.raises(FitInputError, match=message) as e:
        fit(nn.Linear(6, 1), run_dir=tmp_path / "run", **kwargs)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_ignored_keys_and_a_stretched_schedule_warn(tmp_path):
    from kiln import FitWarning

    data = TensorDataset(X, Y[:, None])
    with pytest.warns(FitWarning, match=r"fit\(\) ignores data.seq_len, model.n_layer, train.sample_tokens: these "
                                        r"keys set up kiln's own language model"):
        fit(nn.Linear(6, 1), data, loss="mse", run_dir=tmp_path / "a", config=BASE | {
            "model.n_layer": 2, "data.seq_len": 64, "train.sample_tokens": 0, "train.max_steps": 2})
    with pytest.warns(FitWarning, match=r"epochs=1 sets the run's length: train.time_budget is not used; drop it"):
        fit(nn.Linear(6, 1), data, loss="mse", epochs=1, config=BASE | {"train.time_budget": 5.0},
            run_dir=tmp_path / "budget")
    config = BASE | {"schedule.warmup_steps": 0, "train.grad_accum_steps": 1}
    fit(nn.Linear(6, 1), data, loss="mse", epochs=1, config=config, run_dir=tmp_path / "b")  # 5 steps
    lr = [1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / n))) for n in (5, 10)]  # cosine at step 5 of 5, 10
    with pytest.warns(FitWarning, match=rf"resume at step 5: train.max_steps 5 → 10 changes the cosine schedule, "
                                        rf"whose length is train.max_steps while schedule.total_steps=0: the lr at "
                                        rf"step 5 becomes {lr[1]:.3g} \(it was {lr[0]:.3g}\); to keep the old "
                                        rf"schedule set schedule.total_steps=5"):
        fit(nn.Linear(6, 1), data, loss="mse", epochs=2, config=config, run_dir=tmp_path / "b", resume=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit horizon: nothing to warn about
        fit(nn.Linear(6, 1), data, loss="mse", config=config | {"schedule.total_steps": 10, "train.max_steps": 5},
            run_dir=tmp_path / "c")
        fit(nn.Linear(6, 1), data, loss="mse", config=config | {"schedule.total_steps": 10, "train.max_steps": 10},
            run_dir=tmp_path / "c", resume=True)


def test_defaults_for_a_model_of_its_own_and_counts_for_people(tmp_path):
    from kiln.util import format_count

    assert [format_count(n) for n in (7, 999, 5_000, 5_049, 99_949, 123_456, 999_500, 1_234_567, 3_400_000_000)] \
        == ["7", "999", "5.0k", "5.0k", "99.9k", "123k", "1.0M", "1.2M", "3.4B"]
    out = io.StringIO()
    model = nn.Sequential(nn.Linear(6, 700), nn.Linear(700, 1))  # 5,601 parameters
    bare = {k: v for k, v in BASE.items() if not k.startswith(("optim.", "schedule."))}
    result = fit(model, TensorDataset(X, Y[:, None]), loss="mse", config=bare | {"train.max_steps": 40},
                 console=Console(file=out, width=300), run_dir=tmp_path / "run")
    text = out.getvalue()
    assert "model: Sequential 5.6k parameters |" in text
    assert ("defaults for a model of your own: optim.lr=0.001, optim.weight_decay=0.01, schedule.warmup_steps=2 "
            "(set them in config= to choose)") in text
    assert (result.cfg.optim.lr, result.cfg.optim.weight_decay, result.cfg.schedule.warmup_steps) == (1e-3, 0.01, 2)
    given = fit(nn.Linear(6, 1), TensorDataset(X, Y[:, None]), loss="mse", run_dir=tmp_path / "given",
                config=BASE | {"train.max_steps": 2, "optim.lr": 2e-3, "optim.weight_decay": 0.1,
                               "schedule.warmup_steps": 1})
    assert (given.cfg.optim.lr, given.cfg.optim.weight_decay, given.cfg.schedule.warmup_steps) == (2e-3, 0.1, 1)
