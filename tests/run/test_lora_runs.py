"""Training with LoRA adapters: `kiln train` (the base frozen and stored as the precision mode says, the optimizer
over the adapters only, the start line), `kiln.fit` on a model of the user's, gradient accumulation, NaN tracing
into an adapted linear, `kiln doctor` on a fine-tune, and the refusals of what LoRA does not combine with."""
import io
import json
import math

import pytest
import torch
import torch.nn as nn
from rich.console import Console
from torch.utils.data import TensorDataset

from kiln import fit
from kiln.cli.main import main
from kiln.interop.hf import write_hf
from kiln.models import param_count
from kiln.models.lora import LoraLinear, lora_tensors
from kiln.numerics.trace import REPORT_FILE
from kiln.report import collect
from kiln.report.page import _summary_rows
from kiln.run.doctor import Doctor
from kiln.run.lm import build_lm, train

LORA = {"rank": 4, "alpha": 8.0}


def _lora_cfg(small_config, mode="fp32", **sections):
    return small_config(lora=LORA, precision={"mode": mode}, optim={"lr": 1e-2}, **sections)


@pytest.mark.parametrize("mode, frozen, adapters", [
    ("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.float32),
    ("bf16-master", torch.bfloat16, torch.bfloat16), ("fp16", torch.float32, torch.float32)])
def test_the_base_is_frozen_and_stored_as_the_mode_says(small_config, tmp_path, mode, frozen, adapters):
    lm = build_lm(_lora_cfg(small_config, mode), tmp_path, log=lambda msg: None)
    try:
        st = lm.state
        params = dict(st.model.named_parameters())
        lora = {n: p for n, p in params.items() if ".lora_" in n}
        base = {n: p for n, p in params.items() if ".lora_" not in n}
        assert len(lora) == 2 * 4 * 2 and all(p.requires_grad and p.dtype == adapters for p in lora.values())
        assert all(not p.requires_grad and p.dtype == frozen for p in base.values())
        optimized = {id(p) for g in st.optimizer.param_groups for p in g["params"]}
        if mode == "bf16-master":  # fp32 masters of the adapters only: the base has no master, no state
            assert len(st.masters.pairs) == len(lora) and optimized == {id(m) for m in st.masters.masters}
            assert all(m.dtype == torch.float32 for m in st.masters.masters)
        else:
            assert st.masters is None and optimized == {id(p) for p in lora.values()}
    finally:
        lm.state.loader.close()


def test_a_lora_run_trains_the_adapters_and_leaves_the_base(small_config, tmp_path):
    cfg = _lora_cfg(small_config, "bf16", train={"max_steps": 6})
    out = io.StringIO()
    result = train(cfg, tmp_path / "run", console=Console(file=out, width=200))
    model_cfg = result.state.model.cfg
    n = sum(math.prod(t.shape) for t in lora_tensors(model_cfg, result.cfg.lora))
    m = param_count(model_cfg) + n
    assert n == 8192 and f"lora: rank 4, alpha 8, targets all | trainable {n:,} of {m:,} parameters " \
                          f"({100 * n / m:.2f}%)" in out.getvalue()
    fresh = build_lm(cfg, tmp_path / "fresh", log=lambda msg: None)  # the same seed: the run's starting point
    fresh.state.loader.close()
    before, after = fresh.state.model.state_dict(), result.state.model.state_dict()
    for key, value in after.items():
        if ".lora_B." in key:
            assert value.abs().max() > 0 and before[key].abs().max() == 0, key  # trained from B = 0
        elif ".lora_" not in key:
            assert torch.equal(value, before[key]), key  # the base, bit for bit
    assert math.isfinite(result.val_loss)
    rows = dict(_summary_rows(collect([tmp_path / "run"])))  # kiln report's summary: the share from config.toml
    assert rows["trainable parameters"] == [f"{n:,} of {m:,} ({100 * n / m:.2f}%)"]


@pytest.mark.parametrize("optim", [{"name": "adamw8bit"}, {"offload": "host"}])
def test_lora_with_adamw8bit_and_optimizer_offload(small_config, tmp_path, optim):
    """Supported: the optimizer (8-bit states, or fp32 masters and states on the host) holds the adapters only."""
    cfg = _lora_cfg(small_config, train={"max_steps": 2})
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    result = train(cfg, tmp_path / "run", console=Console(file=io.StringIO()))
    st = result.state
    lora = [p for n, p in st.model.named_parameters() if ".lora_" in n]
    held = [p for g in st.optimizer.param_groups for p in g["params"]]
    assert len(held) == len(lora) == 16 and {id(p) for p in held} == {id(p) for p in lora}
    assert math.isfinite(result.val_loss)


def test_fit_adapts_the_users_linears_by_suffix(tmp_path):
    torch.manual_seed(0)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16)), nn.Tanh(),
                             nn.Linear(16, 3))

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    data = TensorDataset(x, (x @ torch.randn(6, 3, generator=g)).argmax(-1))
    settings = {"lora.rank": 4, "lora.targets": "0,2.0", "train.max_steps": 6, "optim.lr": 3e-2,
                "log.progress": "off", "log.tensorboard": False, "train.device": "cpu", "precision.mode": "fp32",
                "optim.implementation": "foreach"}
    runs = {}
    for name, batch in (("whole", {"train.micro_batch_size": 8}),
                        ("accumulated", {"train.micro_batch_size": 4, "train.grad_accum_steps": 2})):
        net, out = model(), io.StringIO()
        start = {k: v.clone() for k, v in net.state_dict().items()}
        fit(net, data, config=settings | batch, run_dir=tmp_path / name, console=Console(file=out, width=200))
        assert isinstance(net[0], LoraLinear) and isinstance(net[2][0], LoraLinear) and type(net[4]) is nn.Linear
        # adapters 4·(6+16) + 4·(16+16) = 216 beside the model's 435 ("0" also names "2.0", as PEFT's suffixes do)
        assert "lora: rank 4, alpha 16, targets 0,2.0 | trainable 216 of 651 parameters (33.18%)" in out.getvalue()
        state = net.state_dict()
        assert all(torch.equal(state[k], v) for k, v in start.items())  # the base (and the last linear) unchanged
        assert state["0.lora_B.default"].abs().max() > 0
        runs[name] = state
    for key, value in runs["whole"].items():  # 2 micro-batches of 4 accumulated = 1 of 8
        torch.testing.assert_close(runs["accumulated"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_nan_in_an_adapted_linear_is_traced_to_it(small_config, tmp_path):
    cfg = _lora_cfg(small_config, train={"max_steps": 4}, log={"interval": 2},
                    faults={"nan_forward": "blocks.1.attn.qkv@3"})
    result = train(cfg, tmp_path / "run", console=Console(file=io.StringIO()))
    report = json.loads((tmp_path / "run" / REPORT_FILE).read_text())
    assert (report["module"], report["phase"], report["step"]) == ("blocks.1.attn.qkv", "forward", 3)
    assert result.step == 4 and math.isfinite(result.val_loss)  # the NaN step was never applied


def test_doctor_on_a_lora_fine_tune(small_config, tmp_path):
    """A pretrained base (a short kiln run exported to Hugging Face's layout): init_loss is judged against the
    data's unigram loss, weight_std asks the base for finite values and the adapters for PEFT's init, and lora_A's
    zero gradient while B = 0 is no failure."""
    base = train(small_config(train={"max_steps": 12}, optim={"lr": 3e-2}, schedule={"warmup_steps": 2}),
                 tmp_path / "base", console=Console(file=io.StringIO()))
    write_hf(base.state.model.cfg, base.state.model.state_dict(), 256, tmp_path / "hf")
    cfg = _lora_cfg(small_config)
    cfg.model.init = f"hf:{tmp_path / 'hf'}"
    lm = build_lm(cfg, tmp_path / "doctor", log=lambda msg: None)
    try:
        doctor = Doctor(lm, None)
        status, value, fix = doctor.init_loss()
        loss, unigram = float(value.split()[0]), lm.data.unigram_loss
        assert loss < math.log(256) - 1  # the base learned something in 12 steps
        assert status == ("pass" if loss <= unigram else "warn")  # judged against the unigram, not ln(vocab)
        assert f"vs the data's unigram loss {unigram:.3f} and ln(256) = 5.545" in value and "tokenizer" in fix
        status, value, _ = doctor.gradient_flow()
        assert status == "pass", value
        # 28 base tensors: HF's GPT-2 has biases (read_hf builds the model with them)
        assert value == ("all 16 trainable tensors get a gradient (8 LoRA A matrices at 0 while their B is 0, as "
                         "expected at the start); the base's 28 tensors are frozen (lora.rank=4)")
        status, value, _ = doctor.weight_std()
        assert status == "pass" and value.startswith("28 tensors of the pretrained base finite"), value
        with torch.no_grad():  # an adapter that does not start at B = 0 is found
            lm.state.model.blocks[0].attn.qkv.lora_B["c_attn"].fill_(0.1)
        status, value, _ = doctor.weight_std()
        assert status == "fail" and "worst blocks.0.attn.qkv.lora_B.c_attn: max |B| = 0.1" in value
    finally:
        lm.state.loader.close()


@pytest.mark.parametrize("flags, line", [
    (["--parallel.tp=2"], "kiln memory: error: lora.rank=4 with parallel.tp=2: the adapters are not split with "
                          "their linears yet; shard a LoRA run with --parallel.strategy=fsdp (or ddp) and "
                          "parallel.tp=1; use --parallel.tp=1 with --parallel.strategy=fsdp"),
    (["--precision.mode=fp8"], "kiln memory: error: lora.rank=4 with precision.mode=fp8: torchao's float8 linears "
                               "would replace the adapted ones; use --precision.mode=bf16 (the frozen base is stored "
                               "in bf16)"),
    (["--lora.rank=-2"], "kiln memory: error: lora.rank=-2 must be a whole number ≥ 0 (0: no adapters); give e.g. "
                         "--lora.rank=8, or 0 for none"),
])
def test_what_lora_does_not_combine_with_is_refused_in_one_line(flags, line, capsys):
    assert main(["memory", "--out=", "--model.preset=tiny", "--lora.rank=4", *flags]) == 2
    assert capsys.readouterr().err.strip() == line
