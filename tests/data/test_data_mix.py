"""[[data.mix]]: sources drawn by weight as a pure function of (seed, batch), exact resume, world-size independence,
per-source validation losses, and the config round trip."""
import json
import math

import numpy as np
import pytest

from kiln.config import ConfigError, load_config
from kiln.data import DataConfig, Mixture, TokenLoader, cached_unigram_loss, prepare_data
from kiln.data.mix import source_name


def two_sources():
    """Source a holds ids 0-99, source b ids 100-199, so a window's ids say which source it came from."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 100, 5000).astype(np.uint16)
    b = rng.integers(100, 200, 800).astype(np.uint16)
    return Mixture(["a", "b"], [3.0, 1.0], [a, b])


def test_rows_follow_the_weights_within_binomial_tolerance():
    mix = two_sources()
    loader = TokenLoader(mix, batch_size=8, seq_len=16, seed=5, prefetch=0)
    rows_from_a = rows = 0
    for _ in range(500):
        x, y = loader.next()
        whole = np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1)
        from_a = (whole < 100).all(axis=1)
        assert (from_a | (whole >= 100).all(axis=1)).all()  # a window never crosses from one source to another
        rows_from_a += int(from_a.sum())
        rows += len(whole)
    p, sigma = 0.75, math.sqrt(0.75 * 0.25 / rows)
    assert abs(rows_from_a / rows - p) < 4 * sigma, (rows_from_a / rows, sigma)


def test_batches_are_a_pure_function_of_seed_and_index_for_any_world_size_and_resume():
    mix = two_sources()
    one = TokenLoader(mix, 4, 16, seed=1, prefetch=0)
    stream = [one.next()[0].numpy() for _ in range(8)]
    ranks = [TokenLoader(mix, 4, 16, seed=1, prefetch=0, rank=r, world=2) for r in (0, 1)]
    interleaved = [ranks[i % 2].next()[0].numpy() for i in range(8)]
    for got, want in zip(interleaved, stream):
        np.testing.assert_array_equal(got, want)
    resumed = TokenLoader(mix, 4, 16, seed=1, prefetch=0)
    first = TokenLoader(mix, 4, 16, seed=1, prefetch=0)
    for _ in range(5):
        first.next()
    resumed.load_state_dict(first.state_dict())
    for want in stream[5:]:
        np.testing.assert_array_equal(resumed.next()[0].numpy(), want)
    other = TokenLoader(mix, 4, 16, seed=2, prefetch=0)
    assert not np.array_equal(other.next()[0].numpy(), stream[0])


def test_source_names_and_mix_errors(tmp_path):
    assert source_name("dir/b.jsonl.gz") == "b" and source_name("/x/fineweb") == "fineweb"
    path = tmp_path / "run.toml"
    path.write_text('[[data.mix]]\nsource = "x/a.jsonl"\n[[data.mix]]\nsource = "y/a.txt"\nweight = 2\n')
    with pytest.raises(ConfigError, match=r"the name\(s\) \['a'\] are used twice"):
        load_config(path)
    with pytest.raises(ConfigError, match="data.source='z' and \\[\\[data.mix\\]\\] are both set"):
        load_config(path, ["--data.source=z"])
    with pytest.raises(ConfigError, match="weight=0 must be a number > 0"):
        load_config(None, ['--data.mix=[{source = "a", weight = 0}]'])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['sorce'\]"):
        load_config(None, ['--data.mix=[{sorce = "a"}]'])
    with pytest.raises(ConfigError, match="a data.format=tokens source in \\[\\[data.mix\\]\\].*hf:DIR"):
        load_config(None, ["--data.tokenizer=bpe", '--data.mix=[{source = "a", format = "tokens"}]'])


def test_a_mixed_run_logs_per_source_val_losses_and_saves_its_mix(small_config, corpus_file, tmp_path):
    from kiln.run.lm import train  # lazy: the training stack is only needed by this test

    second = tmp_path / "other.txt"
    second.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(3000)))
    cfg = small_config(train={"max_steps": 2, "eval_interval": 1})
    cfg.data.source = "stdlib"  # the default: a mixture replaces it
    cfg.data.mix = ({"source": str(corpus_file), "weight": 3.0}, {"source": str(second), "weight": 1.0,
                                                                   "name": "fox"})
    train(cfg, tmp_path / "run")
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert evals
    for r in evals:
        assert r["val_loss"] == pytest.approx((3 * r["val_loss/corpus"] + r["val_loss/fox"]) / 4, rel=1e-9)
        assert r["val_loss/fox"] != r["val_loss/corpus"]
    from kiln.report.figures import build_charts  # lazy: as above
    from kiln.report.runs import read_run

    chart = next(c for c in build_charts([read_run(tmp_path / "run")], [None]) if c.key == "val_loss_sources")
    assert [line.label for line in chart.lines] == ["corpus", "fox"] and len({line.run for line in chart.lines}) == 2
    saved = load_config(tmp_path / "run" / "config.toml")  # what --resume reads
    assert saved.data.mix == cfg.data.mix
    alone = prepare_data(DataConfig(source=str(second), seq_len=32), log=lambda m: None)
    assert alone.val.shape[0] > 32


def test_one_bpe_tokenizer_is_trained_across_the_sources_by_weight_and_shared(tmp_path):
    """A few KB per source: the sample takes each source's share of data.tokenizer_sample_bytes by weight, both
    sources' words become tokens, every source's cache holds the one tokenizer and its key follows it."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"zebra quokka zebra quokka {i}"}) + "\n"
                                              for i in range(150)))
    (tmp_path / "b.txt").write_text("".join(f"lambda walrus: walrus * {i}\n" for i in range(150)))
    mix = ({"source": str(tmp_path / "a.jsonl"), "weight": 3}, {"source": str(tmp_path / "b.txt"), "weight": 1})
    cfg = DataConfig(mix=mix, tokenizer="bpe", vocab_size=300, tokenizer_sample_bytes=4000, seq_len=8,
                     cache_dir=str(tmp_path / "c"))
    log = []
    got = prepare_data(cfg, log=log.append)
    (shared,) = [p for p in (tmp_path / "c").iterdir() if p.name.startswith("mix-bpe-") and p.is_dir()]
    meta = json.loads((shared / "meta.json").read_text())
    assert [(name, limit) for name, limit, _ in meta["sources"]] == [("a", 3000), ("b", 1000)]
    assert [name for name, _, taken in meta["sources"] if not 0 < taken < 1.2 * dict(a=3000, b=1000)[name]] == []
    vocab = got.tokenizer._tok.get_vocab()
    assert {"zebra", "quokka", "walrus", "lambda"} <= {t.lstrip("Ġ") for t in vocab}  # from both sources
    assert {json.loads((p.cache_dir / "meta.json").read_text())["fingerprint"] for _, _, p in got.sources} == \
        {got.tokenizer.fingerprint}
    assert got.tokenizer.decode(got.sources[1][2].train[:12].tolist()).startswith("lambda walrus")
    again = []
    assert prepare_data(cfg, log=again.append).tokenizer.fingerprint == got.tokenizer.fingerprint
    assert not any("training" in line for line in again) and all("built at" not in line for line in again)
    assert cached_unigram_loss(cfg) == pytest.approx(got.unigram_loss)
    other = prepare_data(DataConfig(**{**cfg.__dict__, "vocab_size": 280}), log=lambda m: None)
    assert {p.cache_dir for _, _, p in other.sources}.isdisjoint({p.cache_dir for _, _, p in got.sources})
