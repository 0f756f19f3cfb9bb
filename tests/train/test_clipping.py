"""Gradient clipping by value and by an adaptive threshold (AutoClip), against float64 references."""
import json

import numpy as np
import pytest
import torch
import torch.nn as nn

from kiln.run.lm import train
from kiln.train.optim import AdaptiveClip, OptimConfig, clip_gradients
from kiln.train.precision import LossScaler, Precision, PrecisionConfig
from kiln.train.step import train_step


def _params_with_grads(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(shape)) for shape in ((5, 3), (7,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


def test_value_clipping_clamps_each_element_and_reports_the_norm_before():
    params = _params_with_grads(0, scale=2.0)
    ref = [p.grad.double().clone() for p in params]
    norm, threshold = clip_gradients(params, OptimConfig(clip_mode="value", grad_clip=0.5))
    assert threshold is None
    assert norm.item() == pytest.approx(torch.cat([r.flatten() for r in ref]).norm().item(), rel=1e-6)
    for p, r in zip(params, ref):
        assert torch.equal(p.grad.double(), r.clamp(-0.5, 0.5).float().double())


def test_adaptive_clipping_is_the_percentile_of_the_norms_so_far():
    """Each step's threshold is numpy's percentile of every finite norm so far (this one included), in float64; the
    gradients are scaled by min(1, threshold / norm); a non-finite norm never enters the history."""
    cfg = OptimConfig(clip_mode="adaptive", clip_percentile=25.0, clip_history=6)
    clip = AdaptiveClip(cfg.clip_percentile, cfg.clip_history, "cpu")
    history = []
    for step, scale in enumerate([1.0, 3.0, 0.5, 2.0, float("nan"), 8.0, 1.5, 0.7, 4.0]):
        params = _params_with_grads(step, scale)
        ref = [p.grad.double().clone() for p in params]
        norm, threshold = clip_gradients(params, cfg, clip)
        ref_norm = torch.cat([r.flatten() for r in ref]).norm().item()
        if np.isfinite(ref_norm):
            history = (history + [np.float32(ref_norm)])[-6:]
        assert threshold.item() == pytest.approx(np.percentile(np.array(history, dtype=np.float64), 25), rel=1e-6)
        if np.isfinite(ref_norm):
            coef = min(1.0, threshold.item() / (ref_norm + 1e-6))
            for p, r in zip(params, ref):
                torch.testing.assert_close(p.grad.double(), r * coef, rtol=1e-6, atol=1e-7)


def _regression_run(clip_mode: str, grad_clip: float) -> tuple[float, float]:
    """A linear regression trained by SGD with a gradient explosion planted at step 30 (targets × 1e4 for one
    batch): (loss on clean data before the explosion, and after it)."""
    torch.manual_seed(0)
    w_true = torch.randn(8, 1)
    model = nn.Linear(8, 1)

    class MSE:
        unit = "samples"

        def __call__(self, model, batch):
            x, y = batch
            return ((model(x) - y) ** 2).sum()

        def count(self, batch):
            return torch.tensor(float(len(batch[0])))

    cfg = OptimConfig(name="sgd", lr=0.05, momentum=0.0, weight_decay=0.0, clip_mode=clip_mode, grad_clip=grad_clip,
                      clip_percentile=10.0)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    precision = Precision("fp32", torch.device("cpu"))
    scaler = LossScaler(PrecisionConfig(), torch.device("cpu"), enabled=False)
    adaptive = AdaptiveClip(cfg.clip_percentile, cfg.clip_history, "cpu") if clip_mode == "adaptive" else None
    x_eval = torch.randn(256, 8)

    def clean_loss():
        with torch.no_grad():
            return ((model(x_eval) - x_eval @ w_true) ** 2).mean().item()

    before = None
    for step in range(40):
        x = torch.randn(16, 8)
        y = x @ w_true * (1e4 if step == 30 else 1.0)
        if step == 30:
            before = clean_loss()
        train_step(model, [(x, y)], MSE(), opt, precision, scaler, cfg, adaptive_clip=adaptive)
    return before, clean_loss()


def test_adaptive_clipping_tames_an_explosion_that_a_bad_fixed_threshold_lets_through():
    before_fixed, after_fixed = _regression_run("norm", grad_clip=1000.0)  # a threshold set far too high
    before_adaptive, after_adaptive = _regression_run("adaptive", grad_clip=1000.0)
    assert before_fixed == pytest.approx(before_adaptive, rel=0.5)  # both had converged alike before step 30
    assert after_fixed > 100 * max(before_fixed, 1e-3)  # the fixed threshold let the explosion in
    assert after_adaptive < 2 * before_adaptive + 0.05  # the adaptive one kept it to a normal step


def test_adaptive_clipping_resumes_bit_identically_and_logs_its_threshold(small_config, tmp_path):
    optim = {"clip_mode": "adaptive", "clip_percentile": 50.0, "clip_history": 4}
    schedule = {"total_steps": 8}  # the same learning-rate curve whichever run stops at step 4
    train(small_config(train={"max_steps": 8}, optim=optim, schedule=schedule), tmp_path / "straight")
    train(small_config(train={"max_steps": 4}, optim=optim, schedule=schedule, checkpoint={"interval": 4}),
          tmp_path / "resumed")
    train(small_config(train={"max_steps": 8}, optim=optim, schedule=schedule), tmp_path / "resumed", resume=True)

    def records(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "train"]

    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [(r["loss"], r["grad_norm"], r["clip_threshold"]) for r in straight] == \
           [(r["loss"], r["grad_norm"], r["clip_threshold"]) for r in resumed]
    norms = [r["grad_norm"] for r in straight]
    for i, r in enumerate(straight):  # the median of the last 4 norms, this one included
        assert r["clip_threshold"] == pytest.approx(float(np.median(norms[max(0, i - 3):i + 1])), rel=1e-5)
