import torch

from kiln.models import ModelConfig, build_model
from kiln.train.optim import OptimConfig, build_optimizer
from kiln.train.precision import LossScaler, Precision, PrecisionConfig
from kiln.train.objective import LanguageModeling
from kiln.train.step import train_step


def test_tiny_overfits_one_batch():
    """The real `tiny` shape memorizes one batch: loss < 0.05 within 300 steps."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny", vocab_size=256))
    cpu = torch.device("cpu")
    opt_cfg = OptimConfig(lr=1e-3, weight_decay=0.0)
    optimizer = build_optimizer(model, opt_cfg)
    scaler = LossScaler(PrecisionConfig(), cpu, enabled=False)
    data = torch.randint(0, 256, (2, 65))
    batch = [(data[:, :-1], data[:, 1:])]
    losses = []
    for _ in range(300):
        result = train_step(model, batch, LanguageModeling(), optimizer, Precision("fp32", cpu), scaler, opt_cfg)
        losses.append(result.loss.item())
        if losses[-1] < 0.05:
            break
    assert losses[0] > 5.0, losses[0]  # random tokens: starts near ln(256)
    assert losses[-1] < 0.05, f"loss {losses[-1]:.4f} after {len(losses)} steps"
