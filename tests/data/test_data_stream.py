"""Streaming prepare: shards and their index, parallel workers byte for byte, resume after kill -9, the lock,
compressed and pre-tokenized inputs, bad records, bounded memory."""
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.data import DataConfig, prepare_data
from kiln.data import prepare as prep
from kiln.data.corpus import CorpusError
from kiln.data.shards import ShardedTokens, write_shard

WORDS = "the model reads tokens and learns which token comes next from many small files of text".split()
ROOT = Path(__file__).resolve().parents[2]


class Log(list):
    def __call__(self, line):
        self.append(line)


def write_jsonl(path, n, seed=0, field="text"):
    rng = random.Random(seed)
    rows = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + f" #{i}" for i in range(n)]
    path.write_text("".join(json.dumps({field: r}) + "\n" for r in rows))
    return rows


def cache_files(directory):
    """name -> bytes of every cache file the byte-identity promise covers (not *.json metadata)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix != ".json"}


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(prep, "PIECE_BYTES", 4096)  # many pieces from a small corpus


def test_shards_and_index_hold_the_one_shard_stream(tmp_path, small_pieces):
    write_jsonl(tmp_path / "a.jsonl", 600)
    one = prepare_data(DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c1")), log=Log())
    many = prepare_data(DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c2"),
                                   shard_tokens=1000), log=Log())
    meta = json.loads((many.cache_dir / "meta.json").read_text())
    assert len(meta["shards"]["train"]) == -(-len(one.train) // 1000) > 5
    sizes = [(many.cache_dir / f).stat().st_size for f in meta["shards"]["train"]]
    assert sizes[:-1] == [64 + 1000] * (len(sizes) - 1)  # full shards: header + 1000 uint8 (bytes) tokens
    assert isinstance(many.train, ShardedTokens)
    np.testing.assert_array_equal(np.asarray(many.train), np.asarray(one.train))
    np.testing.assert_array_equal(np.asarray(many.val), np.asarray(one.val))
    assert many.unigram_loss == pytest.approx(one.unigram_loss, rel=1e-12)


def test_sharded_view_reads_windows_across_boundaries():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 500, n).astype(np.uint16) for n in (7, 1, 50, 13)]
    joined = np.concatenate(parts)
    view = ShardedTokens(parts)
    starts = np.arange(0, len(joined) - 9)
    np.testing.assert_array_equal(view[starts[:, None] + np.arange(10)], joined[starts[:, None] + np.arange(10)])
    for a, b in [(0, 71), (5, 9), (6, 8), (8, 58), (70, 71), (3, 3)]:
        np.testing.assert_array_equal(view[a:b], joined[a:b])
    assert len(view) == 71 and view.max() == joined.max() and np.max(view) == joined.max()
    with pytest.raises(IndexError):
        view[np.array([71])]


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_workers_write_the_same_bytes_as_one(tmp_path, small_pieces, tokenizer):
    """bpe: every piece goes to a worker; bytes: text pieces are copied by the parent between the workers' JSONL."""
    write_jsonl(tmp_path / "a.jsonl", 400)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b"".join((tmp_path / "a.jsonl").open("rb").readlines()[:150])))
    for i in range(3):
        (tmp_path / f"a{i}.txt").write_text(" ".join(WORDS[i:]) * (20 + 90 * i) + "\n")  # between a and b
    dirs = []
    for workers in (1, 2):
        cfg = DataConfig(source=str(tmp_path), pattern="[ab]*.*", cache_dir=str(tmp_path / f"c{workers}"),
                         workers=workers, shard_tokens=3000, tokenizer=tokenizer, vocab_size=300)
        dirs.append(prepare_data(cfg, log=Log()).cache_dir)
    assert dirs[0].name == dirs[1].name  # the worker count is not part of the cache key
    one, two = cache_files(dirs[0]), cache_files(dirs[1])
    assert len(one) > 4 and one == two
    assert json.loads((dirs[1] / "meta.json").read_text())["workers"] == 2
    assert not [p for p in dirs[1].iterdir() if "piece" in p.name or ".tmp" in p.name]


KILLED = textwrap.dedent("""
    import os, sys, time
    import kiln.data as data
    from kiln.data import prepare as prep
    prep.PIECE_BYTES = 4096
    begin = prep.Sink.begin
    def slow(self, piece):  # pieces 0-4 are in the shards: the test kills this process here
        if piece == 5 and self.split == "train":
            print("killable", flush=True)
            time.sleep(60)
        begin(self, piece)
    prep.Sink.begin = slow
    data.prepare_data(data.DataConfig(source=sys.argv[1], cache_dir=sys.argv[2], shard_tokens=1500,
                                      workers=int(sys.argv[3])), log=print)
""")


def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path, small_pieces, workers=2):
    write_jsonl(tmp_path / "a.jsonl", 500)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path / "a.jsonl"), str(tmp_path / "c"), str(workers)],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "killable"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = next((tmp_path / "c").glob("*.partial"))
    assert (partial / "progress.json").is_file() and list(partial.glob("train-*.bin"))
    log = Log()
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c"), shard_tokens=1500,
                     workers=3 - workers)  # the rerun's worker count may differ
    resumed = prepare_data(cfg, log=log)
    reused = [line for line in log if "resuming" in line]
    assert reused and "reused " in reused[0], log
    assert json.loads((resumed.cache_dir / "meta.json").read_text())["resumed"]["shards"] >= 1
    fresh = prepare_data(DataConfig(source=cfg.source, cache_dir=str(tmp_path / "fresh"), shard_tokens=1500),
                         log=Log())
    assert cache_files(resumed.cache_dir) == cache_files(fresh.cache_dir)
    assert not list((tmp_path / "c").glob("*.partial"))


def test_a_second_prepare_waits_for_the_lock(tmp_path):
    final = tmp_path / "cache" / "x"
    with prep.cache_lock(final, Log()):
        with pytest.raises(prep.CacheBusy, match="being prepared by pid"):
            with prep.cache_lock(final, Log(), wait=False):
                pass
        got, log = [], Log()
        waiter = threading.Thread(target=lambda: got.append(prep.cache_lock(final, log).__enter__()))
        # flock is per open file, so a second open in this process waits like another process would
        waiter.start()
        time.sleep(0.3)
        assert not got and "waiting for" in log[0]
    waiter.join(5)
    assert got


def test_compressed_jsonl_gives_the_same_tokens_as_plain(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    write_jsonl(tmp_path / "plain.jsonl", 200)
    raw = (tmp_path / "plain.jsonl").read_bytes()
    (tmp_path / "gz.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "zst.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    out = {}
    for name in ("plain.jsonl", "gz.jsonl.gz", "zst.jsonl.zst"):
        got = prepare_data(DataConfig(source=str(tmp_path / name), cache_dir=str(tmp_path / "c")), log=Log())
        out[name] = (np.asarray(got.train).tolist(), np.asarray(got.val).tolist())
    assert out["plain.jsonl"] == out["gz.jsonl.gz"] == out["zst.jsonl.zst"]


def test_nanogpt_and_llmc_token_files_read_back_as_written(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 50257, 5000).astype(np.uint16), rng.integers(0, 50257, 700).astype(np.uint16)
    nano = tmp_path / "nano"
    nano.mkdir()
    train.tofile(nano / "train.bin")
    val.tofile(nano / "val.bin")
    llmc = tmp_path / "llmc"
    llmc.mkdir()
    for name, tokens in (("fw_train_000001.bin", train[:3000]), ("fw_train_000002.bin", train[3000:]),
                         ("fw_val_000000.bin", val)):
        header = np.zeros(256, np.int32)
        header[:3] = [20240520, 1, len(tokens)]
        (llmc / name).write_bytes(header.tobytes() + tokens.tobytes())
    log = Log()
    for source in (nano, llmc):
        got = prepare_data(DataConfig(source=str(source), format="tokens", vocab_size=50257,
                                      cache_dir=str(tmp_path / "c")), run_dir=tmp_path / "run", log=log)
        np.testing.assert_array_equal(np.asarray(got.train), train)
        np.testing.assert_array_equal(np.asarray(got.val), val)
        assert got.tokenizer.vocab_size == 50257
    assert any("bytes tokenizer is ignored" in line for line in log)
    with pytest.raises(CorpusError, match=r"fw_train_000001.bin: token \d+ is id \d+, outside data.vocab_size=1000"):
        prepare_data(DataConfig(source=str(llmc), format="tokens", vocab_size=1000, cache_dir=str(tmp_path / "c")),
                     log=Log())


BAD = {
    "invalid json": (b'{"text": "fine"}\n{"text": oops}\n', r"a.jsonl:2: not valid JSON .*data.on_bad_record=skip"),
    "no field": (b'{"text": "fine"}\n{"body": "x"}\n', r"a.jsonl:2: no field 'text' \(found \['body'\]\)"),
    "not utf-8": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"a.jsonl:2: byte \d+ of the line is not UTF-8"),
    "not a string": (b'{"text": "fine"}\n{"text": 5}\n', r"a.jsonl:2: field 'text' is int, expected a string"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_record_is_one_line_naming_file_and_line_or_is_skipped(tmp_path, case):
    bad, pattern = BAD[case]
    good = b"".join(json.dumps({"text": f"good record {i} " * 5}).encode() + b"\n" for i in range(30))
    (tmp_path / "a.jsonl").write_bytes(bad + good)
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(CorpusError, match=pattern) as info:
        prepare_data(cfg, log=Log())
    assert "\n" not in str(info.value)
    assert [p.suffix for p in (tmp_path / "c").iterdir()] == [".lock"]  # no cache directory, complete or partial
    log = Log()
    cfg.on_bad_record = "skip"
    got = prepare_data(cfg, log=log)
    assert "| 1 bad records skipped |" in next(line for line in log if "summary" in line)
    assert json.loads((got.cache_dir / "meta.json").read_text())["docs"] == 31


def test_non_utf8_text_file_and_binary_file_are_refused(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"hello\n" * 50 + b"caf\xe9\n")
    (tmp_path / "t" / "b.txt").write_text("other text\n" * 50)
    with pytest.raises(CorpusError, match=r"a.txt: byte 303 is not UTF-8 .*data.on_bad_record=skip"):
        prepare_data(DataConfig(source=str(tmp_path / "t"), cache_dir=str(tmp_path / "c")), log=Log())
    got = prepare_data(DataConfig(source=str(tmp_path / "t"), cache_dir=str(tmp_path / "c"), on_bad_record="skip"),
                       log=Log())
    assert "caf\ufffd" in got.tokenizer.decode(np.concatenate([got.train, got.val]).tolist())


def test_a_full_disk_leaves_a_resumable_partial_cache_and_a_clear_error(tmp_path, monkeypatch, small_pieces):
    write_jsonl(tmp_path / "a.jsonl", 300)
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c"), shard_tokens=2000)
    append = prep.ShardWriter.append
    calls = [0]

    def full(self, ids):
        calls[0] += 1
        if calls[0] == 9:
            raise OSError(28, "No space left on device", str(self.path))
        append(self, ids)

    monkeypatch.setattr(prep.ShardWriter, "append", full)
    with pytest.raises(OSError, match="No space left"):
        prepare_data(cfg, log=Log())
    assert not [p for p in (tmp_path / "c").iterdir() if p.is_dir() and not p.name.endswith(".partial")]
    monkeypatch.setattr(prep.ShardWriter, "append", append)
    again = prepare_data(cfg, log=Log())
    fresh = prepare_data(DataConfig(source=cfg.source, cache_dir=str(tmp_path / "f"), shard_tokens=2000), log=Log())
    assert cache_files(again.cache_dir) == cache_files(fresh.cache_dir)


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """Prepare 2 MB and 10 MB of JSONL under tracemalloc (numpy's buffers included): the peak grows by far less than
    the 8 MB more text (a prepare that held the corpus would grow by > 2x it: text + tokens)."""
    import tracemalloc

    monkeypatch.setattr(prep, "PIECE_BYTES", 256 << 10)
    line = json.dumps({"text": " ".join(WORDS) * 4 + " #@"}) + "\n"
    peaks = {}
    for mb in (2, 10):
        path = tmp_path / f"c{mb}.jsonl"
        path.write_text("".join(line.replace("@", str(i)) for i in range(mb * 2**20 // len(line))))
        tracemalloc.start()
        prepare_data(DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), workers=1,
                                shard_tokens=4_000_000), log=Log())
        peaks[mb] = tracemalloc.get_traced_memory()[1] / 2**20  # MiB
        tracemalloc.stop()
    assert peaks[10] - peaks[2] < 1, peaks  # vs 8 MiB more text (measured: +0.04 MiB)
    assert peaks[10] < 24, peaks  # measured 16 MiB: a 4M-token uint16 flush buffer per split


def test_an_old_single_file_cache_is_not_misread(tmp_path):
    """A cache directory from before shards (train.bin/val.bin, no shard list) under the current key is rebuilt."""
    (tmp_path / "a.txt").write_text("some words here\n" * 200)
    cfg = DataConfig(source=str(tmp_path / "a.txt"), cache_dir=str(tmp_path / "c"))
    first = prepare_data(cfg, log=Log())
    meta = json.loads((first.cache_dir / "meta.json").read_text())
    del meta["shards"]
    (first.cache_dir / "meta.json").write_text(json.dumps(meta))
    write_shard(first.cache_dir / "train.bin", np.zeros(10, np.uint16), first.tokenizer.fingerprint)
    log = Log()
    again = prepare_data(cfg, log=log)
    assert "is damaged" in log[0] and "lists no shards" in log[0]
    np.testing.assert_array_equal(np.asarray(again.train), np.asarray(first.train))


def test_a_bad_record_found_by_a_worker_process_is_the_same_one_line_error(tmp_path, small_pieces):
    rows = [json.dumps({"text": f"good record {i} " * 20}) for i in range(300)]
    rows[250] = '{"text": oops}'
    (tmp_path / "a.jsonl").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c"), workers=2)
    with pytest.raises(CorpusError, match=r"a.jsonl:251: not valid JSON"):
        prepare_data(cfg, log=Log())


def test_bpe_trains_on_a_bounded_seeded_sample_from_many_pieces(tmp_path, small_pieces):
    rows = write_jsonl(tmp_path / "a.jsonl", 2000)
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), tokenizer="bpe", tokenizer_sample_bytes=20_000)
    pieces = prep.plan_pieces(cfg)
    sample = list(prep.tokenizer_sample(cfg, pieces, cfg.tokenizer_sample_bytes))
    assert sample == list(prep.tokenizer_sample(cfg, pieces, cfg.tokenizer_sample_bytes))  # seeded
    longest = max(map(len, rows))
    assert 20_000 <= sum(map(len, sample)) < 20_000 + longest
    numbers = sorted(int(t.rsplit("#", 1)[1]) for t in sample)
    assert numbers[-1] - numbers[0] > 1000  # drawn from pieces all over the corpus, not its first 20 kB
    assert set(sample) <= set(rows)
