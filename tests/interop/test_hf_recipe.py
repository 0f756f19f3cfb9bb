"""model.init=hf:DIR with the recipe keys (docs/models.md, "Recipe parts"): model.logit_softcap applies to the
checkpoint's model; a model.mlp or model.qk_norm other than the checkpoint's is refused before its weights are
read, the checkpoint's own accepted; model.zero_init_proj is refused with the config."""
import pytest
import torch
import torch.nn.functional as F

from kiln.config import ConfigError, load_config
from kiln.errors import KilnError
from kiln.run.lm import build_lm, train
from tests.interop.test_hf import _hf_model

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")

CAP = 0.5  # below the random GPT-2's largest logits (~0.9): capped and uncapped logits differ by up to ~0.45


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A random 2-layer GPT-2 (GELU, no QK-norm) and a random Qwen3 (SwiGLU, QK-norm), as transformers saves them."""
    out = tmp_path_factory.mktemp("hub")
    for kind in ("gpt2", "qwen3"):
        _hf_model(kind).save_pretrained(out / kind)
    return out


def _cfg(hub, kind, *extra):
    return load_config(None, [f"--model.init=hf:{hub / kind}", "--train.device=cpu", "--precision.mode=fp32",
                              "--data.seq_len=16", "--train.micro_batch_size=2", *extra])


def test_a_soft_cap_applies_to_the_checkpoints_model(hub, small_config, tmp_path):
    """The run's model is the checkpoint's with logits cap·tanh(logits/cap): logits and loss against transformers'
    logits capped in float64."""
    lm = build_lm(_cfg(hub, "gpt2", f"--model.logit_softcap={CAP}"), device=torch.device("cpu"), with_data=False)
    model = lm.state.model.eval()
    assert model.cfg.logit_softcap == CAP and model.cfg.vocab_size == 301
    hf = _hf_model("gpt2", torch.float64)
    torch.manual_seed(0)
    ids = torch.randint(0, 301, (2, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        raw = hf(x).logits  # (2, 16, 301), float64
        want = CAP * torch.tanh(raw / CAP)
        got = model(x)
        assert (got[..., :301].double() - want).abs().max().item() <= 1e-5
        assert (raw - want).abs().max().item() > 0.3  # the cap moved them: an uncapped model fails the line above
        # kiln's loss takes the padded vocabulary's rows too (their logits are 0, capped 0)
        padded = torch.cat([want, want.new_zeros(2, 16, model.cfg.padded_vocab - 301)], -1)
        ref = F.cross_entropy(padded.flatten(0, 1), y.flatten())
        assert model(x, y).item() == pytest.approx(ref.item(), rel=1e-6)
    # and it trains so: the run's recorded model keeps the cap
    cfg = small_config(train={"max_steps": 2}, model={"logit_softcap": CAP})
    cfg.model.init = f"hf:{hub / 'gpt2'}"
    result = train(cfg, tmp_path / "run")
    assert result.state.model.cfg.logit_softcap == CAP
    assert "logit_softcap = 0.5" in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.parametrize("kind,extra,message", [
    ("gpt2", "--model.mlp=relu2", "model.mlp='relu2' with model.init=hf:{dir}: the checkpoint's MLP is 'gelu' and its "
                                  "weights were trained through it; drop --model.mlp (or give 'gelu') with model.init, "
                                  "or train from scratch without model.init"),
    ("gpt2", "--model.mlp=swiglu", "model.mlp='swiglu' with model.init=hf:{dir}: the checkpoint's MLP is 'gelu' and "
                                   "its weights were trained through it; drop --model.mlp (or give 'gelu') with "
                                   "model.init, or train from scratch without model.init"),
    ("gpt2", "--model.qk_norm=true", "model.qk_norm=true with model.init=hf:{dir}: the checkpoint's gpt2 has no "
                                     "QK-norm and its weights were trained without it; drop --model.qk_norm with "
                                     "model.init, or train from scratch without model.init"),
    ("qwen3", "--model.qk_norm=false", "model.qk_norm=false with model.init=hf:{dir}: the checkpoint's qwen3 has "
                                       "QK-norm and its weights were trained with it; drop --model.qk_norm with "
                                       "model.init, or train from scratch without model.init"),
])
def test_an_mlp_or_qk_norm_the_checkpoint_lacks_is_refused_before_its_weights(hub, tmp_path, kind, extra, message):
    directory = tmp_path / kind  # config.json alone: the refusal comes before any tensor is read
    directory.mkdir()
    (directory / "config.json").write_text((hub / kind / "config.json").read_text())
    with pytest.raises(KilnError) as e:
        build_lm(_cfg(tmp_path, kind, extra), device=torch.device("cpu"), with_data=False)
    assert str(e.value) == message.format(dir=directory)


@pytest.mark.parametrize("kind,extra", [("gpt2", "--model.mlp=gelu"), ("gpt2", "--model.qk_norm=false"),
                                        ("qwen3", "--model.mlp=swiglu"), ("qwen3", "--model.qk_norm=true")])
def test_the_checkpoints_own_parts_are_accepted(hub, kind, extra):
    lm = build_lm(_cfg(hub, kind, extra), device=torch.device("cpu"), with_data=False)
    hf = _hf_model(kind)
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert (lm.state.model.eval()(ids)[..., :hf.config.vocab_size] - hf(ids).logits).abs().max().item() <= 1e-5


def test_zero_initialised_projections_are_refused_with_the_config(hub):
    with pytest.raises(ConfigError) as e:
        _cfg(hub, "gpt2", "--model.zero_init_proj=true")
    assert str(e.value) == (f"model.zero_init_proj=true starts the output projections at 0, and model.init=hf:"
                            f"{hub / 'gpt2'} loads them from the checkpoint; drop --model.zero_init_proj (set it "
                            f"false) with model.init")
