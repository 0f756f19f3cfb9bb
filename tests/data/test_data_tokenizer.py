"""Byte and BPE tokenizers: round trips, the end-of-text id, save/load."""
import json

import numpy as np
import pytest
import tokenizers

from kiln.data.corpus import stdlib_files
from kiln.data.tokenizer import EOT_TEXT, TOKENIZER_FILE, BPETokenizer, ByteTokenizer, load_tokenizer

SAMPLES = [
    "def f(x):\n    return x + 1\n",
    "naïve café — 東京 🚀\ttabs  and   spaces\r\n",
    "",
    " leading space",
    f"a file that quotes {EOT_TEXT} literally",
]


@pytest.fixture(scope="module")
def bpe():
    # ~60 kB of real Python trains a 400-token vocabulary in well under a second.
    texts = [f.read_text() for f in stdlib_files()[:40]]
    return BPETokenizer.train(texts, vocab_size=400)


@pytest.mark.parametrize("text", SAMPLES)
def test_bytes_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.eot_id not in ids  # 0xFF never occurs in UTF-8
    assert list(tok.encode_batch([text])[0]) == ids


def test_bytes_decode_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([104, 105, tok.eot_id]) == "hi\ufffd"
    assert tok.vocab_size == 256


@pytest.mark.parametrize("text", SAMPLES)
def test_bpe_round_trip(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.eot_id not in ids  # the literal string is ordinary text; only the pipeline inserts EOT
    assert list(bpe.encode_batch([text])[0]) == ids


def test_bpe_learns_merges(bpe):
    text = "    def __init__(self):\n        return self\n"
    assert bpe.vocab_size == 400
    assert len(bpe.encode(text)) < len(text.encode("utf-8")) / 2  # stdlib-trained merges compress code >2x
    assert bpe.decode([bpe.eot_id]) == EOT_TEXT


def test_save_load_keeps_fingerprint_and_ids(bpe, tmp_path):
    for tok in (ByteTokenizer(), bpe):
        run_dir = tmp_path / tok.kind
        tok.save(run_dir)
        loaded = load_tokenizer(run_dir)
        assert type(loaded) is type(tok)
        assert loaded.fingerprint == tok.fingerprint and len(tok.fingerprint) == 16
        assert loaded.vocab_size == tok.vocab_size and loaded.eot_id == tok.eot_id
        for text in SAMPLES:
            assert loaded.encode(text) == tok.encode(text)
    # The BPE file is a plain `tokenizers` file, usable without kiln.
    plain = tokenizers.Tokenizer.from_file(str(tmp_path / "bpe" / TOKENIZER_FILE))
    assert plain.get_vocab_size() == 400
    assert json.loads((tmp_path / "bytes" / TOKENIZER_FILE).read_text())["kind"] == "bytes"


def test_fingerprint_tells_tokenizers_apart(bpe):
    other = BPETokenizer.train([f.read_text() for f in stdlib_files()[:40]], vocab_size=300)
    assert len({ByteTokenizer().fingerprint, bpe.fingerprint, other.fingerprint}) == 3


def test_encode_batch_dtypes(bpe):
    assert ByteTokenizer().encode_batch(["ab"])[0].dtype == np.uint8
    assert bpe.encode_batch(["ab"])[0].dtype == np.uint32


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / TOKENIZER_FILE).write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / TOKENIZER_FILE).write_text('{"kind": "sentencepiece"}')
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(tmp_path)
