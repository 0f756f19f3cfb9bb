"""Corpus reading and the train/val split (a document's split is fixed by a hash of its path or its text)."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from kiln.data import DataConfig, prepare_data
from kiln.data.corpus import STDLIB_EXCLUDED_DIRS, CorpusError, source_files, stdlib_files, stdlib_root
from kiln.data.prepare import _cut_point, plan_pieces
from kiln.data import records
from kiln.data.records import BadRecord, _judge, jsonl_records, text_parts, where
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
    piece = {"fmt": "jsonl", "file": str(path), "start": 0, "end": path.stat().st_size}
    records = list(jsonl_records(piece, "body"))
    assert [text for _, text in records] == ["first", "second"]
    assert [where(piece, i).rsplit("/", 1)[1] for i, _ in records] == ["data.jsonl:1", "data.jsonl:3"]


def test_jsonl_fast_path_gives_json_loads_verdict_on_every_line(tmp_path):
    """The block decode + C scanner agree with json.loads of each line's bytes: a BOM, CRLF, surrounding
    whitespace, escapes and lone surrogates, a last line without a line break, non-UTF-8 bytes and a line longer
    than a read block."""
    lines = [b'\xef\xbb\xbf{"text": "bom"}', b'{"text": "crlf"}\r', b'  {"text": "spaces"}  ', b'{"text": "\\ud800 x"}',
             b'{"text": "caf\xc3\xa9 \\u00e9"}', b'[1, 2]', b'{"text": 1}', b'"text"', b'{"text": "a"} x', b'{"t": 1}',
             b'{"text": "\xe9"}', b'{"text": "' + b"long " * 300_000 + b'"}', b"", b'{"text": "last"}']
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines))
    piece = {"fmt": "jsonl", "file": str(path), "start": 0, "end": path.stat().st_size}
    got = [(i, t if isinstance(t, str) else str(t).split(": ", 1)[1]) for i, t in jsonl_records(piece, "text")]
    expected = []
    for i, line in enumerate(lines):
        verdict = _judge(line, "text", piece, i)
        if verdict is not None:
            expected.append((i, verdict if isinstance(verdict, str) else str(verdict).split(": ", 1)[1]))
    assert got == expected
    assert [t for _, t in got][:5] == ["bom", "crlf", "spaces", "\ud800 x", "café é"]


def test_jsonl_bad_line_names_file_and_line_even_in_a_later_piece(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{not json\n')
    start = len('{"text": "ok"}\n')  # a piece that starts at line 2
    (bad,) = [text for _, text in jsonl_records({"fmt": "jsonl", "file": str(path), "start": start,
                                                 "end": path.stat().st_size}, "text") if isinstance(text, Exception)]
    assert "data.jsonl:3: not valid JSON" in str(bad)


def test_format_override_reads_jsonl_as_text(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    train, val = splits(path, tmp_path, format="text")
    assert "".join(train + val) == path.read_text()


@pytest.mark.parametrize("on_bad", ["error", "skip"])
def test_text_bytes_are_the_decoded_text_encoded_whatever_the_blocks(tmp_path, monkeypatch, on_bad):
    """The bytes tokenizer's text path never decodes ASCII blocks and passes the file's own bytes on: the same
    tokens as decoding each block and encoding it again, with characters cut by block ends and (skip) bad bytes."""
    monkeypatch.setattr(records, "TEXT_BLOCK", 7)
    content = "plain ascii, then naïve café — 東京 🚀 and ascii again\n".encode() * 3
    if on_bad == "skip":
        content += b"bad \xff\xfe bytes \xe6\x9d and a cut char at the end \xf0\x9f"
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    segment = {"file": str(path), "start": 0, "end": len(content)}
    stats = {"skipped": 0, "examples": []}
    raw = b"".join(text_parts(segment, on_bad, stats, raw=True))
    decoded = "".join(text_parts(segment, on_bad, {"skipped": 0, "examples": []}))
    assert raw == decoded.encode("utf-8", "surrogatepass")
    assert (raw == content) == (on_bad == "error") and (stats["skipped"] > 0) == (on_bad == "skip")
    if on_bad == "error":
        for at in (6, 40):  # in an ASCII stretch; inside a character (the error names where it starts)
            path.write_bytes(content[:at] + b"\xff" + content[at:])
            errors = set()
            for mode in (True, False):
                with pytest.raises(BadRecord, match=r"t.txt: byte \d+ is not UTF-8") as error:
                    list(text_parts({**segment, "end": len(content) + 1}, on_bad, stats, raw=mode))
                errors.add(str(error.value))
            assert len(errors) == 1 and (at != 6 or "byte 6 " in errors.pop())
