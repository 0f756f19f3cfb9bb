"""Corpus reading and the train/val split (a document's split is fixed by a hash of its path or its text)."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from kiln.data import DataConfig, prepare_data
from kiln.data.corpus import STDLIB_EXCLUDED_DIRS, CorpusError, source_files, stdlib_files, stdlib_root
from kiln.data.prepare import _cut_point, plan_pieces
from kiln.data.records import jsonl_records
from kiln.data.tokenizer import BYTES_EOT


def documents(tokens) -> list[str]:
    """The documents of a bytes-tokenized split, in order."""
    return [bytes(d.astype(np.uint8)).decode() for d in np.split(tokens, np.flatnonzero(tokens == BYTES_EOT) + 1) if len(d)
            for d in [d[d != BYTES_EOT]]]


def splits(source, tmp_path, **kw):
    got = prepare_data(DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw), log=lambda m: None)
    return documents(np.asarray(got.train)), documents(np.asarray(got.val))


def test_stdlib_corpus_is_nonempty_and_excludes_tests_and_packages():
    files = stdlib_files()
    root = stdlib_root()
    rel = [f.relative_to(root) for f in files]
    assert len(files) > 300  # 674 on CPython 3.11
    assert all(f.suffix == ".py" for f in files)
    assert not any(STDLIB_EXCLUDED_DIRS.intersection(r.parts[:-1]) for r in rel)
    assert Path("os.py") in rel and Path("json/decoder.py") in rel
    assert files == sorted(files) == stdlib_files()  # deterministic order


def segments(cfg):
    return [seg for piece in plan_pieces(cfg) for seg in piece["segments"]]


def test_stdlib_split_is_deterministic_disjoint_and_complete():
    cfg = DataConfig()
    first, again = segments(cfg), segments(cfg)
    assert [(s["file"], s["split"]) for s in first] == [(s["file"], s["split"]) for s in again]
    files = {s["file"] for s in first}
    val = {s["file"] for s in first if s["split"] == "val"}
    assert files == {str(f) for f in stdlib_files() if f.stat().st_size}  # empty files add nothing
    assert all(s["start"] == 0 and s["last"] for s in first)  # each file is one document, in one split
    # ~5% of ~670 documents by hash: 33 expected, binomial sd ~6.
    assert 10 <= len(val) <= 70


def test_split_depends_on_the_record_not_its_position(tmp_path):
    texts = [f"record number {i} " * 3 for i in range(200)]
    shuffled = texts[:]
    random.Random(0).shuffle(shuffled)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in shuffled))
    _, val_a = splits(tmp_path / "a.jsonl", tmp_path, val_fraction=0.2)
    _, val_b = splits(tmp_path / "b.jsonl", tmp_path, val_fraction=0.2)
    assert set(val_a) == set(val_b) and 15 < len(val_a) < 65
    # A larger fraction only adds documents to val: a document's position is fixed by its text.
    _, val_bigger = splits(tmp_path / "a.jsonl", tmp_path, val_fraction=0.4)
    assert set(val_a) < set(val_bigger)


def test_single_document_is_cut_at_one_minus_val_fraction(tmp_path):
    text = "".join(f"line {i}\n" for i in range(1000))
    (tmp_path / "a.txt").write_text(text)
    cut = _cut_point(tmp_path / "a.txt", len(text), 0.1)
    assert text[cut - 1] == "\n" and abs((len(text) - cut) / len(text) - 0.1) < 0.01
    train, val = splits(tmp_path / "a.txt", tmp_path, val_fraction=0.1)
    assert train == [text[:cut]] and val == [text[cut:]]


@pytest.mark.parametrize("fraction", [1e-12, 1 - 1e-12])
def test_both_splits_nonempty_even_when_the_hash_sends_everything_one_way(tmp_path, fraction):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"text {k}"}) + "\n" for k in "abc"))
    train, val = splits(tmp_path / "a.jsonl", tmp_path, val_fraction=fraction)
    assert train and val and sorted(train + val) == ["text a", "text b", "text c"]


def test_directory_source_uses_pattern_sorted(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.txt", "skip.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    cfg = DataConfig(source=str(tmp_path), pattern="**/*.txt")
    assert [Path(s["file"]).relative_to(tmp_path).as_posix() for s in segments(cfg)] == ["a.txt", "b.txt", "sub/c.txt"]
    with pytest.raises(CorpusError, match="data.pattern"):
        plan_pieces(DataConfig(source=str(tmp_path), pattern="*.csv"))


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        source_files(str(tmp_path / "nope"), "*.txt")


def test_jsonl_reads_the_text_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"body": "first", "id": 1}\n\n{"body": "second"}\n')
    records = list(jsonl_records({"file": str(path), "start": 0, "end": path.stat().st_size}, "body"))
    assert [text for _, _, text in records] == ["first", "second"]
    assert [where.rsplit("/", 1)[1] for _, where, _ in records] == ["data.jsonl:1", "data.jsonl:3"]


def test_jsonl_bad_line_names_file_and_line_even_in_a_later_piece(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{not json\n')
    start = len('{"text": "ok"}\n')  # a piece that starts at line 2
    (bad,) = [key for key, _, _ in jsonl_records({"file": str(path), "start": start, "end": path.stat().st_size},
                                                  "text") if isinstance(key, Exception)]
    assert "data.jsonl:3: not valid JSON" in str(bad)


def test_format_override_reads_jsonl_as_text(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    train, val = splits(path, tmp_path, format="text")
    assert "".join(train + val) == path.read_text()
