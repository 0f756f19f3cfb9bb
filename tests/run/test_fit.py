"""kiln as a library: fit() on models of the user's own, with each loss; resume, accumulation, NaN tracing, BatchNorm."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
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
