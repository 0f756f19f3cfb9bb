import pytest

from kiln.config import ConfigError, describe, load_config, to_toml


def test_defaults_and_contract_keys_exist():
    cfg = load_config()
    assert cfg.model.preset == "nano"
    assert (cfg.train.max_steps > 0 or cfg.train.time_budget > 0) and cfg.log.interval > 0
    text = describe()
    for key in ("--model.preset", "--train.max_steps", "--log.interval", "--optim.lr", "--precision.mode"):
        assert key in text


def test_every_key_has_help():
    from dataclasses import fields

    from kiln.config import SECTIONS

    described = {}
    for line in describe().splitlines():
        if line.startswith("  --"):
            key, _, rest = line.strip().partition("  ")
            described[key.split("=")[0]] = rest.strip()
    keys = {f"--{name}.{f.name}" for name, cls in SECTIONS.items() for f in fields(cls)}
    assert set(described) == keys  # every key listed (an empty listing would otherwise pass)
    assert not [key for key, text in described.items() if not text], "keys without a description"


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[optim]\nlr = 3e-4\nname = "adam"\n[train]\nmax_steps = 7\n[model]\npreset = "gpt2-124m"\n')
    cfg = load_config(path, ["--train.max_steps=9", "--model.bias=false", "--optim.weight_decay=0"])
    assert cfg.optim.lr == 3e-4 and cfg.optim.name == "adam"
    assert cfg.train.max_steps == 9
    assert cfg.model.bias is False and cfg.optim.weight_decay == 0.0
    assert isinstance(cfg.optim.weight_decay, float)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--model.preset=llama-125m", "--schedule.name=wsd", "--train.sample_prompt=a \"q\""])
    cfg.model = cfg.model.resolve()
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    again = load_config(path)
    assert again == cfg


@pytest.mark.parametrize("override, message", [
    ("--model.presett=tiny", r"did you mean model\.preset\?"),
    ("--optm.lr=1", r"did you mean 'optim'\?"),
    ("--train.max_step=5", r"did you mean train\.max_steps\?"),
    ("--optim.lr=fast", r"optim\.lr='fast' is not a valid float"),
    ("--train.max_steps=1.5", r"train\.max_steps='1.5' is not a valid int"),
    ("--train.max_steps=-1", r"train\.max_steps must be ≥ 0"),
    ("--train.time_budget=0", r"train\.max_steps=0 sizes the run by train\.time_budget"),
    ("--optim.lr=-1", r"optim\.lr must be > 0"),
    ("--precision.mode=fp4", r"precision\.mode='fp4' is unknown"),
    ("--schedule.name=cosin", r"schedule\.name='cosin' is unknown"),
    ("--model.preset=gpt2-125m", r"did you mean 'gpt2-124m'"),
    ("--data.seq_len=0", r"data\.seq_len"),
    ("lr=3", r"--section\.key=value"),
])
def test_bad_overrides_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_bad_toml_types_are_rejected(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[train]\nmax_steps = "ten"\n')
    with pytest.raises(ConfigError, match=r"train\.max_steps=.ten. is not a valid int"):
        load_config(path)
    path.write_text('[train]\nmax_steps = true\n')
    with pytest.raises(ConfigError, match="boolean"):
        load_config(path)
    path.write_text("lr = 3\n")
    with pytest.raises(ConfigError, match=r"must be a \[section\] table"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("overrides, message", [
    (["--data.seq_len=512", "--model.max_seq_len=256"], "data.seq_len=512 exceeds model.max_seq_len=256"),
    (["--train.kernels=triton", "--model.dropout=0.1"], "--model.dropout=0"),
    (["--train.kernels=triton", "--memory.chunked_loss=1024"], "drop --memory.chunked_loss"),
    (["--parallel.tp=2", "--memory.chunked_loss=1024"], "parallel.tp=2 computes the loss on logits split over the "
                                                         "vocabulary .* drop --memory.chunked_loss"),
    (["--faults.spike=5", "--train.compile=true"], "--train.compile=false"),
    (["--memory.offload_blocks=0-7"], "blocks run 0..1"),  # the nano preset has 2 blocks
    (["--model.kernels=triton"], "model.kernels .* is now train.kernels"),
    (["--optim.lr=inf"], "optim.lr=inf is not a finite number"),
    (["--optim.lr=nan"], "optim.lr=nan is not a finite number"),
    (["--optim.grad_clip=nan"], "optim.grad_clip=nan is not a finite number"),
])
def test_cross_section_rules_are_checked_when_the_config_is_loaded(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_config_sections_are_typed():
    import typing

    from kiln.config import Config
    from kiln.train.optim import OptimConfig

    hints = typing.get_type_hints(Config)
    assert hints["optim"] is OptimConfig  # a type checker sees cfg.optim.lr as a float
    assert typing.get_type_hints(OptimConfig)["lr"] is float


def test_apply_overrides_coerces_and_validates():
    from kiln.config import apply_overrides

    cfg = load_config()
    before = (cfg.train.micro_batch_size, cfg.optim.lr)
    out = apply_overrides(cfg, {"train.micro_batch_size": "7", "optim.lr": 1})
    assert out.train.micro_batch_size == 7 and out.optim.lr == 1.0 and isinstance(out.optim.lr, float)
    assert (cfg.train.micro_batch_size, cfg.optim.lr) == before != (7, 1.0)  # the given config is left alone
    with pytest.raises(ConfigError, match="train.micro_batch_size must be ≥ 1"):
        apply_overrides(cfg, {"train.micro_batch_size": 0})


def test_offload_all_is_checked_without_listing_a_billion_blocks():
    # The section's own check once built range(10**9) for "all": the config load hung and then ran out of memory.
    cfg = load_config(None, ["--memory.offload_blocks=all"])
    assert cfg.memory.offload_blocks == "all"
