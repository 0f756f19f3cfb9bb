"""Corpus reading and the train/val split."""
import random
from pathlib import Path

import pytest

from kiln.data.corpus import (
    STDLIB_EXCLUDED_DIRS,
    CorpusError,
    Document,
    load_documents,
    source_files,
    split_documents,
    stdlib_files,
    stdlib_root,
)


def test_stdlib_corpus_is_nonempty_and_excludes_tests_and_packages():
    files = stdlib_files()
    root = stdlib_root()
    rel = [f.relative_to(root) for f in files]
    assert len(files) > 300  # 674 on CPython 3.11
    assert all(f.suffix == ".py" for f in files)
    assert not any(STDLIB_EXCLUDED_DIRS.intersection(r.parts[:-1]) for r in rel)
    assert Path("os.py") in rel and Path("json/decoder.py") in rel
    assert files == sorted(files) == stdlib_files()  # deterministic order


def test_stdlib_split_is_deterministic_disjoint_and_complete():
    docs = load_documents("stdlib")
    train, val = split_documents(docs, 0.05)
    train2, val2 = split_documents(docs, 0.05)
    assert [d.key for d in train] == [d.key for d in train2] and [d.key for d in val] == [d.key for d in val2]
    train_keys, val_keys = {d.key for d in train}, {d.key for d in val}
    assert not train_keys & val_keys
    assert train_keys | val_keys == {d.key for d in docs}
    # ~5% of ~670 documents by hash: 33 expected, binomial sd ~6.
    assert 10 <= len(val) <= 70


def test_split_depends_on_document_key_not_order():
    docs = [Document(key=f"f{i}.txt", name=f"f{i}.txt", text="x" * i) for i in range(1, 200)]
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    _, val = split_documents(docs, 0.2)
    _, val_shuffled = split_documents(shuffled, 0.2)
    assert {d.key for d in val} == {d.key for d in val_shuffled}
    # A larger fraction only adds documents to val: a document's position is fixed by its key.
    _, val_bigger = split_documents(docs, 0.4)
    assert {d.key for d in val} < {d.key for d in val_bigger}


def test_single_document_is_cut_at_one_minus_val_fraction():
    text = "".join(f"line {i}\n" for i in range(1000))
    train, val = split_documents([Document(key="a.txt", name="a.txt", text=text)], 0.1)
    assert len(train) == len(val) == 1
    assert train[0].text + val[0].text == text
    assert val[0].text.startswith("line ")  # cut at a line break
    assert abs(len(val[0].text) / len(text) - 0.1) < 0.01


@pytest.mark.parametrize("fraction", [1e-12, 1 - 1e-12])
def test_both_splits_nonempty_even_when_the_hash_sends_everything_one_way(fraction):
    docs = [Document(key=k, name=k, text="text") for k in ("a", "b", "c")]
    train, val = split_documents(docs, fraction)
    assert train and val and len(train) + len(val) == 3


def test_directory_source_uses_pattern_sorted(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.txt", "skip.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    docs = load_documents(str(tmp_path), pattern="**/*.txt")
    assert [d.key for d in docs] == ["a.txt", "b.txt", "sub/c.txt"]
    assert [d.text for d in docs] == ["a.txt", "b.txt", "sub/c.txt"]
    with pytest.raises(CorpusError, match="data.pattern"):
        load_documents(str(tmp_path), pattern="*.csv")


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        source_files(str(tmp_path / "nope"), "*.txt")


def test_jsonl_reads_the_text_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"body": "first", "id": 1}\n\n{"body": "second"}\n')
    docs = load_documents(str(path), text_field="body")
    assert [d.text for d in docs] == ["first", "second"]
    assert [d.name for d in docs] == ["data.jsonl:1", "data.jsonl:3"]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{not json\n')
    with pytest.raises(CorpusError, match=r"data\.jsonl:3: not valid JSON"):
        load_documents(str(path))
    path.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(CorpusError, match=r"data\.jsonl:2: no field 'text'.*data\.text_field"):
        load_documents(str(path))
    path.write_text('{"text": 5}\n')
    with pytest.raises(CorpusError, match=r"data\.jsonl:1: field 'text' is int"):
        load_documents(str(path))


def test_format_override_reads_jsonl_as_text(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n')
    assert load_documents(str(path), fmt="text")[0].text == '{"text": "a"}\n'
