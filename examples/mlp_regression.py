"""An MLP regresses y = sin(x·w) + noise with kiln's loop, once with MSE and once with Huber.

5% of the training targets are glitches (+4, as from a faulty sensor); the validation targets are clean. MSE chases
the glitches, Huber (linear beyond delta=1) mostly ignores them, so Huber's validation MSE comes out lower.

    python examples/mlp_regression.py [--loss mse|huber|both] [--run-dir DIR] [--quick]
"""
import argparse
import time

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from kiln import fit

D_IN, N_TRAIN, N_VAL, NOISE = 8, 4000, 2000, 0.1


def make_data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = 2 * torch.randn(D_IN, 1, generator=g) / D_IN ** 0.5  # x·w ~ N(0, ~4): several periods of the sine
    x = torch.randn(N_TRAIN + N_VAL, D_IN, generator=g)
    y = torch.sin(x @ w) + NOISE * torch.randn(N_TRAIN + N_VAL, 1, generator=g)  # (N, 1)
    glitch = torch.rand(N_TRAIN, 1, generator=g) < 0.05
    y_train = y[:N_TRAIN] + 4.0 * glitch
    return TensorDataset(x[:N_TRAIN], y_train), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 1))


def val_mse(model: nn.Module, val: TensorDataset) -> float:
    x, y = val.tensors
    model.eval()
    with torch.no_grad():
        pred = model(x.to(next(model.parameters()).device)).cpu()
    return torch.mean((pred - y) ** 2).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", choices=["mse", "huber", "both"], default="both")
    p.add_argument("--run-dir", default=f"runs/mlp_regression-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    args = p.parse_args()

    train, val = make_data()
    config = {"train.max_steps": 10 if args.quick else 3000, "train.micro_batch_size": 64, "optim.lr": 3e-3,
              "optim.weight_decay": 0.1, "schedule.warmup_steps": 50, "log.interval": 500,
              # glitches make the per-batch loss heavy-tailed; that is the data, not a training spike
              "numerics.spike_policy": "off"}
    losses = ["mse", "huber"] if args.loss == "both" else [args.loss]
    scores = {}
    for loss in losses:
        torch.manual_seed(0)  # the same initial weights for both losses
        result = fit(mlp(), train, loss=loss, config=config, eval_data=val, run_dir=f"{args.run_dir}/{loss}")
        scores[loss] = val_mse(result.state.model, val)

    y_val = val.tensors[1]
    baseline = torch.mean((y_val - y_val.mean()) ** 2).item()
    print(f"\nvalidation MSE on {N_VAL} clean held-out points (noise floor {NOISE ** 2:.4f}):")
    print(f"  predict the mean        {baseline:.4f}")
    for loss, mse in scores.items():
        print(f"  MLP trained on {loss:<5}    {mse:.4f}   ({mse / baseline:.1%} of the mean's)")


if __name__ == "__main__":
    main()
