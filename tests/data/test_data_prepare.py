"""prepare_data end to end: building, caching, reuse, errors; DataConfig validation."""
import json
import random

import numpy as np
import pytest

import kiln.data as data
import kiln.data.prepared as prepared  # prepare_data calls build from there
from kiln.data import DataConfig, ShardError, load_tokenizer, prepare_data
from kiln.data.tokenizer import BYTES_EOT

WORDS = "the model reads tokens and learns which token comes next from many small files of text".split()


def write_corpus(root, n_files=40, words_per_file=300):
    """A directory of small generated text files (a private Random: global RNG stays untouched)."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for i in range(n_files):
        text = " ".join(rng.choice(WORDS) for _ in range(words_per_file)) + f"\nfile {i} ends.\n"
        (root / f"doc{i:02d}.txt").write_text(text)
        texts[f"doc{i:02d}.txt"] = text
    return texts


class Log(list):
    def __call__(self, line):
        self.append(line)


def test_bytes_corpus_builds_then_reuses_cache(tmp_path, monkeypatch):
    texts = write_corpus(tmp_path / "corpus")
    cfg = DataConfig(source=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    log = Log()
    first = prepare_data(cfg, log=log)
    assert "corpus 40 docs" in log[-1] and "built at" in log[-1]
    total_bytes = sum(len(t.encode()) for t in texts.values())
    # Every document's bytes plus one end-of-text id each, split between train and val.
    assert len(first.train) + len(first.val) == total_bytes + len(texts)
    assert (first.train == BYTES_EOT).sum() + (first.val == BYTES_EOT).sum() == len(texts)
    assert first.train.dtype == np.uint8 and isinstance(first.train, np.memmap)  # the bytes tokenizer: uint8
    assert len(first.val) > 0
    decoded = first.tokenizer.decode(first.train.tolist())
    assert sum(t in decoded for t in texts.values()) == (first.train == BYTES_EOT).sum()

    shard = first.cache_dir / "train-00000.bin"
    mtime = shard.stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(prepared, "build", no_rebuild)
    second = prepare_data(cfg, log=log)
    assert "cached at" in log[-1] and second.cache_dir == first.cache_dir
    assert shard.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(second.train, first.train)
    assert second.unigram_loss == first.unigram_loss


def test_changing_a_source_file_or_a_setting_rebuilds(tmp_path):
    write_corpus(tmp_path / "corpus", n_files=5)
    cfg = DataConfig(source=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    first = prepare_data(cfg, log=Log())
    (tmp_path / "corpus" / "doc00.txt").write_text("changed and longer than before " * 100)
    assert prepare_data(cfg, log=Log()).cache_dir != first.cache_dir
    cfg.val_fraction = 0.3
    assert prepare_data(cfg, log=Log()).cache_dir != first.cache_dir
    # A setting that does not apply to this source keeps the cache.
    cfg2 = DataConfig(source=cfg.source, cache_dir=cfg.cache_dir, val_fraction=0.3, vocab_size=999)
    assert prepare_data(cfg2, log=Log()).cache_dir == prepare_data(cfg, log=Log()).cache_dir


def test_bpe_corpus_trains_once_and_saves_tokenizer_to_run_dir(tmp_path, monkeypatch):
    texts = write_corpus(tmp_path / "corpus")
    cfg = DataConfig(
        source=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), tokenizer="bpe", vocab_size=300
    )
    first = prepare_data(cfg, run_dir=tmp_path / "run", log=Log())
    tok = first.tokenizer
    assert tok.kind == "bpe" and tok.vocab_size == 300
    assert len(first.train) < sum(map(len, texts.values())) / 2  # the repetitive vocabulary compresses >2x
    text = texts["doc03.txt"]
    assert tok.decode(tok.encode(text)) == text
    saved = load_tokenizer(tmp_path / "run")
    assert saved.fingerprint == tok.fingerprint

    monkeypatch.setattr(prepared, "build", lambda *a, **k: pytest.fail("BPE was retrained"))
    second = prepare_data(cfg, log=Log())
    assert second.tokenizer.fingerprint == tok.fingerprint  # the cached tokenizer matches the shard headers
    np.testing.assert_array_equal(second.val, first.val)


def test_unigram_loss_is_the_train_split_entropy(tmp_path):
    write_corpus(tmp_path / "corpus", n_files=8)
    cfg = DataConfig(source=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"))
    prepared = prepare_data(cfg, log=Log())
    _, counts = np.unique(np.asarray(prepared.train), return_counts=True)
    p = counts / counts.sum()
    assert prepared.unigram_loss == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)
    assert 0 < prepared.unigram_loss < np.log(len(counts))


def test_default_stdlib_source(tmp_path):
    log = Log()
    prepared = prepare_data(DataConfig(cache_dir=str(tmp_path)), log=log)
    assert log[-1].startswith("data: stdlib ")
    assert int(log[-1].split()[2]) > 300  # documents
    assert len(prepared.train) > 5_000_000 and len(prepared.val) > 50_000  # ~11 MB of source on 3.11
    # Python source in bytes: ~3.2 nats/token for a unigram model; a real model should beat that.
    assert 2.5 < prepared.unigram_loss < 4.5


def test_single_file_is_split_in_two(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("".join(f"sentence number {i}.\n" for i in range(2000)))
    prepared = prepare_data(DataConfig(source=str(path), cache_dir=str(tmp_path / "c"), val_fraction=0.1), log=Log())
    total = len(prepared.train) + len(prepared.val)
    assert total == path.stat().st_size + 2  # one end-of-text id after each part
    assert len(prepared.val) / total == pytest.approx(0.1, abs=0.01)


def test_jsonl_source(tmp_path):
    path = tmp_path / "records.jsonl"
    rows = [{"body": f"record {i}: " + "words " * 20} for i in range(50)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source=str(path), text_field="body", cache_dir=str(tmp_path / "c"))
    prepared = prepare_data(cfg, log=Log())
    text = prepared.tokenizer.decode(np.concatenate([prepared.train, prepared.val]).tolist())
    assert text.count("record ") == 50 and '"body"' not in text


@pytest.mark.parametrize("damage", ["truncated shard", "extra bytes", "garbage tokenizer", "no tokenizer",
                                    "garbage meta", "wrong count"])
def test_a_damaged_cache_is_detected_and_rebuilt(tmp_path, damage):
    write_corpus(tmp_path / "corpus", n_files=4)
    cfg = DataConfig(source=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"))
    good = prepare_data(cfg, log=Log())
    cache = good.cache_dir
    train, val = np.array(good.train), np.array(good.val)
    if damage == "truncated shard":
        (cache / "val-00000.bin").write_bytes((cache / "val-00000.bin").read_bytes()[:-1])
    elif damage == "extra bytes":
        (cache / "train-00000.bin").write_bytes((cache / "train-00000.bin").read_bytes() + b"\0\0")
    elif damage == "garbage tokenizer":
        (cache / "tokenizer.json").write_text("{not json")
    elif damage == "no tokenizer":
        (cache / "tokenizer.json").unlink()
    elif damage == "garbage meta":
        (cache / "meta.json").write_text("{not json")
    else:
        meta = json.loads((cache / "meta.json").read_text())
        (cache / "meta.json").write_text(json.dumps(meta | {"train_tokens": meta["train_tokens"] + 7}))
    log = Log()
    again = prepare_data(cfg, log=log)
    assert "is damaged" in log[0] and "rebuilding it" in log[0], log
    assert "built at" in log[-1]
    assert np.array_equal(again.train, train) and np.array_equal(again.val, val)
    left = sorted(p.name for p in cache.parent.iterdir() if p.suffix != ".lock")  # the lock file stays, empty of data
    assert left == [cache.name]  # nothing left aside


def test_cache_dir_defaults_to_kiln_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "env"))
    assert data.cache_root(DataConfig()) == tmp_path / "env"
    assert data.cache_root(DataConfig(cache_dir=str(tmp_path / "x"))) == tmp_path / "x"


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("seq_len", 0, r"data\.seq_len=0 must be >= 1"),
        ("val_fraction", 0.0, r"data\.val_fraction=0.0 must be strictly between 0 and 1"),
        ("val_fraction", 1.0, r"data\.val_fraction"),
        ("tokenizer", "sentencepiece", r"data\.tokenizer='sentencepiece' is unknown; use one of"),
        ("format", "csv", r"data\.format='csv' is unknown"),
        ("vocab_size", 256, r"data\.vocab_size=256 .*at least 257"),
        ("prefetch", -1, r"data\.prefetch=-1"),
        ("seed", -5, r"data\.seed=-5"),
        ("source", "", r"data\.source is empty"),
        ("text_field", "", r"data\.text_field is empty"),
    ],
)
def test_validate_names_the_bad_field(field, value, match):
    cfg = DataConfig(tokenizer="bpe") if field == "vocab_size" else DataConfig()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_defaults_are_valid_and_bytes_ignores_vocab_size():
    DataConfig().validate()
    assert DataConfig().tokenizer == "bytes"
    DataConfig(vocab_size=10).validate()  # bytes has a fixed 256-id vocabulary: vocab_size is not read
    with pytest.raises(ValueError, match="data.vocab_size=10 is out of range for bpe"):
        DataConfig(tokenizer="bpe", vocab_size=10).validate()  # the same value where it is read


def test_parquet_and_datasets_directories_are_sources(tmp_path):
    """A Parquet file and a directory saved by `datasets`' save_to_disk give the same documents as the JSONL file of
    the same records; only the text column is read."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (the test extra has it)")
    texts = [f"record {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40)) for i in range(60)]
    rows = {"text": texts, "label": list(range(60))}
    (tmp_path / "records.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ds = datasets.Dataset.from_dict(rows)
    ds.to_parquet(str(tmp_path / "records.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    tokens = {}
    for name in ("records.jsonl", "records.parquet", "saved"):
        cfg = DataConfig(source=str(tmp_path / name), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
        data = prepare_data(cfg, log=Log())
        tokens[name] = (np.asarray(data.train).tolist(), np.asarray(data.val).tolist())
    assert tokens["records.parquet"] == tokens["records.jsonl"] == tokens["saved"]
    with pytest.raises(ValueError, match="no column 'body'.*data.text_field"):
        prepare_data(DataConfig(source=str(tmp_path / "records.parquet"), text_field="body",
                                cache_dir=str(tmp_path / "cache")), log=Log())
