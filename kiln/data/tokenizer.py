"""Two tokenizers behind one small protocol: raw UTF-8 bytes, and byte-level BPE trained with `tokenizers`.

Both mark the end of a document with one token id (`eot_id`) that ordinary text can never produce:

- bytes: 0xFF. Valid UTF-8 never contains that byte, and text is always encoded from `str`, so the id is
  unambiguous. It decodes to U+FFFD, a visible marker in samples.
- BPE: the special token "<|endoftext|>" (id 0). Text containing that literal string is tokenized as ordinary
  characters (encode_special_tokens), so only the data pipeline ever inserts the id.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

from kiln.errors import KilnError

TOKENIZER_FILE = "tokenizer.json"
EOT_TEXT = "<|endoftext|>"
EOT_FILE = "tokenizer_eot.json"  # beside an imported tokenizer.json: the id that ends a document
BYTES_EOT = 0xFF


class Tokenizer(Protocol):
    kind: str  # "bytes" or "bpe"
    vocab_size: int  # true vocabulary size (256 for bytes); the model pads it to a multiple of 64
    fingerprint: str  # 16 hex digits identifying kind + vocabulary; stored in shard headers
    eot_id: int  # id placed after every document

    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, text: str) -> list[int]: ...  # a rendered chat template: its special tokens are ids
    def chat_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...  # and each id's characters
    def decode(self, ids: list[int]) -> str: ...
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def save(self, run_dir: Path) -> None: ...


def _fingerprint(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


class ByteTokenizer:
    """ids 0-255 are the UTF-8 bytes of the text."""

    kind = "bytes"
    vocab_size = 256
    eot_id = BYTES_EOT
    fingerprint = _fingerprint("bytes", "utf-8", str(BYTES_EOT))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, text: str) -> list[int]:
        return self.encode(text)  # no special tokens: a template's markers are text

    def chat_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode_chat's ids and each one's [start, end) character span in `text` (a character's bytes share it)."""
        ids, offsets = [], []
        for i, ch in enumerate(text):
            b = ch.encode("utf-8", "surrogatepass")
            ids += b
            offsets += [(i, i + 1)] * len(b)
        return ids, offsets

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # np.frombuffer avoids a Python int per byte: ~100x faster than encode() on the 11 MB stdlib.
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def save(self, run_dir: Path) -> None:
        # Written even though there is nothing to learn, so load_tokenizer(run_dir) works for every run.
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        payload = {"kind": self.kind, "vocab_size": self.vocab_size, "eot_id": self.eot_id}
        (Path(run_dir) / TOKENIZER_FILE).write_text(json.dumps(payload) + "\n")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BPETokenizer:
    """Byte-level BPE: any string round-trips exactly, decode(encode(s)) == s."""

    kind = "bpe"

    def __init__(self, tok, eot_id: int | None = None) -> None:  # tok: tokenizers.Tokenizer
        self._tok = tok
        # Without this, a source file that quotes "<|endoftext|>" would inject document boundaries.
        self._tok.encode_special_tokens = True
        eot = tok.token_to_id(EOT_TEXT) if eot_id is None else eot_id
        if eot is None:
            raise KilnError(f"BPE tokenizer has no {EOT_TEXT!r} token; it was not trained by kiln",
                            key="tokenizer.json", fix="it was not trained by kiln")
        self.eot_id: int = eot
        self.vocab_size: int = tok.get_vocab_size()
        model = json.loads(tok.to_str())
        # Hash the learned content only (vocab + merges + special tokens), not the serializer's layout, so
        # the fingerprint survives a save/load round trip and minor `tokenizers` upgrades.
        self.fingerprint: str = _fingerprint(
            "bpe",
            json.dumps(model["model"]["vocab"], sort_keys=True),
            json.dumps(model["model"]["merges"]),
            json.dumps([t["content"] for t in model["added_tokens"]]),
        )

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TEXT],
            # All 256 byte symbols up front, so bytes unseen in training still encode (no unknown token).
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)  # 4096 tokens on the 11 MB stdlib: ~2.5 s on 2 cores
        return cls(tok)

    @classmethod
    def from_file(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    @classmethod
    def from_hf(cls, directory: Path) -> "BPETokenizer":
        """A Hugging Face model directory's tokenizer.json; documents end with its end-of-text token
        ({EOT_TEXT!r}, else the eos_token_id of its config.json)."""
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(Path(directory) / TOKENIZER_FILE))
        eot = tok.token_to_id(EOT_TEXT)
        config = Path(directory) / "config.json"
        if eot is None and config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
            eot = eos[0] if isinstance(eos, list) else eos
        if eot is None:
            raise KilnError(f"{directory}: its tokenizer has no {EOT_TEXT!r} and config.json no eos_token_id; kiln "
                            f"needs one to mark where documents end", key=str(directory),
                            fix="kiln needs one to mark where documents end")
        return cls(tok, eot)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_chat(self, text: str) -> list[int]:
        """Text rendered by a chat template (kiln.data.chat): the special tokens written in it (<|im_start|>,
        <|im_end|>) are their ids, as transformers' apply_chat_template encodes it."""
        self._tok.encode_special_tokens = False
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = True

    def encode_as_transformers(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """What transformers' tokenizer.encode(text) gives with its defaults (lm-evaluation-harness's tok_encode,
        kiln.evaluate.encoding): the special tokens written in `text` are their ids, and tokenizer.json's
        post-processor adds its own (a Llama's BOS) unless add_special_tokens is False."""
        self._tok.encode_special_tokens = False
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self._tok.encode_special_tokens = True

    def chat_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """encode_chat's ids and each one's [start, end) character span in `text`, as the Encoding's offsets give it
        (transformers' char_to_token reads the same)."""
        self._tok.encode_special_tokens = False
        try:
            encoding = self._tok.encode(text, add_special_tokens=False)
        finally:
            self._tok.encode_special_tokens = True
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)  # parallel in Rust
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def save(self, run_dir: Path) -> None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        # The `tokenizers` format as-is, so the file also opens with tokenizers.Tokenizer.from_file.
        self._tok.save(str(Path(run_dir) / TOKENIZER_FILE))
        if self._tok.token_to_id(EOT_TEXT) != self.eot_id:  # an imported tokenizer: which id ends a document
            (Path(run_dir) / EOT_FILE).write_text(json.dumps({"eot_id": self.eot_id}) + "\n")

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


class IdsTokenizer:
    """The stand-in of a pre-tokenized corpus (data.format=tokens) without a tokenizer: ids only, shown as <id>."""

    kind = "ids"
    eot_id = -1  # the files' own end-of-text id is unknown here; nothing is inserted

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.fingerprint = _fingerprint("ids", str(vocab_size))

    def encode(self, text: str) -> list[int]:
        raise KilnError("this run reads pre-tokenized files without a tokenizer, so it cannot encode text; give "
                        "data.tokenizer=hf:DIR (the files' tokenizer) to sample from a prompt", key="data.tokenizer",
                        fix="give data.tokenizer=hf:DIR (the files' tokenizer) to sample from a prompt")

    def encode_chat(self, text: str) -> list[int]:
        return self.encode(text)

    def chat_offsets(self, text: str):
        return self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(self.encode(t)) for t in texts]

    def save(self, run_dir: Path) -> None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / TOKENIZER_FILE).write_text(json.dumps({"kind": self.kind, "vocab_size": self.vocab_size})
                                                    + "\n")

    def __repr__(self) -> str:
        return f"IdsTokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(run_dir: Path) -> Tokenizer:
    """The tokenizer saved in run_dir (or in a shard cache directory) by `save`."""
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; the run directory has no saved tokenizer")
    try:
        payload = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # binary bytes are damage too
        why = getattr(e, "msg", "binary bytes, not UTF-8")
        raise KilnError(f"{path} is not valid JSON ({why}); delete it and re-run prepare to rebuild", key=str(path),
                        fix="delete it and re-run prepare to rebuild") from None
    if not isinstance(payload, dict):
        raise KilnError(f"{path} is JSON but not a tokenizer; delete it and re-run prepare to rebuild", key=str(path),
                        fix="delete it and re-run prepare to rebuild")
    if payload.get("kind") == "bytes":
        return ByteTokenizer()
    if payload.get("kind") == "ids":
        return IdsTokenizer(int(payload["vocab_size"]))
    if "model" in payload:
        eot = Path(run_dir) / EOT_FILE
        if eot.is_file():
            return BPETokenizer(BPETokenizer.from_file(path)._tok, json.loads(eot.read_text())["eot_id"])
        return BPETokenizer.from_file(path)
    raise KilnError(f"{path} is neither a kiln bytes tokenizer nor a `tokenizers` BPE file", key=str(path))


def build_tokenizer(kind: str, train_texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.train(train_texts, vocab_size)
    if kind.startswith("hf:"):
        return BPETokenizer.from_hf(Path(kind[3:]))
    raise KilnError(f"data.tokenizer={kind!r} is unknown; use 'bytes' or 'bpe'",
                    key="data.tokenizer", value=kind, fix="use 'bytes' or 'bpe'")
