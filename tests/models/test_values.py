"""Model values that cannot train are refused at config time, and an explicit sentinel is used or refused."""
from dataclasses import replace

import pytest

from kiln.config import ConfigError, load_config
from kiln.models import PRESETS
from kiln.models.values import check_values


def test_rope_theta_of_zero_is_refused_for_a_rotary_model():
    llama = PRESETS["llama-125m"].resolve()
    check_values(llama)  # the preset itself is fine
    for theta in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError) as e:
            check_values(replace(llama, rope_theta=theta))
        assert str(e.value).startswith(f"model.rope_theta={theta:g}: arch='llama' rotates queries and keys by RoPE")
        assert "set --model.rope_theta=10000" in str(e.value)
    check_values(replace(PRESETS["gpt2-124m"].resolve(), rope_theta=0.0))  # no RoPE in gpt2: 0 is fine
    with pytest.raises(ValueError, match=r"model.norm_eps=0: normalization divides .* --model.norm_eps=1e-5"):
        check_values(replace(llama, norm_eps=0.0))


def test_llama_arch_on_a_gpt2_preset_is_valid_or_refused():
    """`--model.arch=llama` on the default preset used to keep its rope_theta of 0 and train NaN; now the config
    either gets a usable rope_theta (from the family's defaults) or is refused with the key and the fix."""
    try:
        cfg = load_config(None, ["--model.arch=llama"])
    except ConfigError as e:
        assert "model.rope_theta=0: arch='llama'" in str(e) and "--model.rope_theta=10000" in str(e)
        assert "\n" not in str(e)
    else:
        assert cfg.model.resolve().rope_theta > 0
    assert load_config(None, ["--model.arch=llama", "--model.rope_theta=10000"]).model.resolve().rope_theta == 1e4


@pytest.mark.parametrize("override, preset, says", [
    ("--model.vocab_size=0", "gpt2-124m", "preset 'gpt2-124m' has vocab_size=50257"),
    ("--model.n_layer=0", "nano", "preset 'nano' has n_layer=2"),
    ("--model.rope_theta=0", "llama-125m", "preset 'llama-125m' has rope_theta=10000.0"),
    ("--model.n_kv_head=0", "llama-125m", "means \"the preset's value\" or n_head"),
    ("--model.tie_embeddings=none", "gpt2-124m", "preset 'gpt2-124m' has tie_embeddings=True"),
])
def test_an_explicit_sentinel_the_preset_would_replace_is_refused(override, preset, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--model.preset={preset}", override])
    msg = str(e.value)
    assert msg.startswith(f"{override.split('=')[0]}=") and "would be ignored" in msg and says in msg
    assert "drop the override" in msg


def test_a_sentinel_with_a_meaning_of_its_own_is_used(tmp_path):
    # nano has no vocabulary: 0 means the tokenizer's, which is what it gets; d_ff=0 derives 4·d_model.
    cfg = load_config(None, ["--model.vocab_size=0", "--model.d_ff=0"])
    assert cfg.model.resolve().vocab_size == 0 and cfg.model.resolve().d_ff == 4 * 256
    # A TOML file may hold zeros (to_toml of an unresolved config writes them): they keep meaning "the preset's".
    path = tmp_path / "c.toml"
    path.write_text('[model]\npreset = "gpt2-124m"\nvocab_size = 0\nn_layer = 0\n')
    assert load_config(path).model.resolve().vocab_size == 50257
