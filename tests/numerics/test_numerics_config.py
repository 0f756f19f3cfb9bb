"""The numerics and faults sections: overrides, loud errors, fault specs checked against the model."""
import pytest
import torch

from kiln.config import ConfigError, load_config
from kiln.models import build_model
from kiln.numerics.faults import FaultInjector, FaultsConfig, parse_spec
from tests.conftest import small_model


def test_overrides_reach_the_sections():
    cfg = load_config(None, ["--numerics.spike_policy=rollback", "--numerics.rollback_lr_factor=0.5",
                             "--faults.nan_forward=blocks.2.mlp@20", "--faults.spike=7"])
    assert (cfg.numerics.spike_policy, cfg.numerics.rollback_lr_factor) == ("rollback", 0.5)
    assert (cfg.faults.nan_forward, cfg.faults.spike) == ("blocks.2.mlp@20", 7)


@pytest.mark.parametrize("override, message", [
    ("--numerics.spike_policy=rolback", "spike_policy"),
    ("--numerics.rollback_from=cloud", "rollback_from"),
    ("--faults.nan_forward=blocks.2.mlp", "MODULE@STEP"),
    ("--faults.inf_backward=blocks.1.attn@9-3", "FIRST ≤ LAST"),
    ("--faults.slow_forward_ms=-5", "faults.slow_forward_ms must be ≥ 0"),
    ("--numerics.spike_treshold=3", "did you mean numerics.spike_threshold"),
])
def test_bad_values_fail_loudly(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_spec_ranges():
    assert parse_spec("blocks.2.mlp@20") == ("blocks.2.mlp", 20, 20)
    assert parse_spec("blocks.0.attn.qkv@5-9") == ("blocks.0.attn.qkv", 5, 9)


def test_unknown_module_names_the_nearest():
    model = build_model(small_model(vocab_size=64))
    with pytest.raises(ValueError, match="did you mean 'blocks.1.mlp'"):
        FaultInjector(FaultsConfig(nan_forward="blocks.1.mpl@3"), model, 64)
    with pytest.raises(ValueError, match="token ids"):
        FaultInjector(FaultsConfig(inf_backward="embed@3"), model, 64)


def test_faults_fire_only_at_their_steps_and_are_removable():
    torch.manual_seed(0)
    model = build_model(small_model(vocab_size=64))
    faults = FaultInjector(FaultsConfig(nan_forward="blocks.0.mlp@3-4"), model, 64)
    x = torch.randint(0, 64, (1, 8))
    for step, finite in [(2, True), (3, False), (4, False), (5, True)]:
        faults.begin_step(step)
        assert bool(torch.isfinite(model(x)).all()) == finite, step
    faults.begin_step(3)
    faults.close()
    assert bool(torch.isfinite(model(x)).all())
