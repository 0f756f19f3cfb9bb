"""The `data` section (DataConfig): where text comes from, how it is split and tokenized, how batches are drawn;
validate() names the field and the fix for the first bad value."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.data.corpus import STDLIB, by_extension, sources
from kiln.data.mix import check_mix, mix_sources
from kiln.data.sft import check_chat
from kiln.data.tokenizer import TOKENIZER_FILE
from kiln.errors import KilnError

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow", "tokens")
ON_BAD_RECORD = ("error", "skip")
TOKENIZERS = ("bytes", "bpe")


@dataclass
class DataConfig:
    """The `data` section: where text comes from, how it is split and tokenized, and how batches are drawn."""

    source: str = field(default=STDLIB, metadata={"help": sources()})  # help: what kiln.data.corpus reads
    format: str = field(default="auto", metadata={"help": (  # auto's rule from the table file_kind reads
        f"auto (by extension: {by_extension()}) | text | jsonl | parquet | arrow (a `datasets` shard; its directory "
        f"works) | tokens (pre-tokenized nanoGPT train.bin/val.bin or llm.c shards; the model's vocabulary is then "
        f"data.vocab_size)")})
    text_field: str = "text"  # the JSONL field, or the Parquet / `datasets` column, holding each record's text
    pattern: str = "**/*.txt"  # glob of files to read when source is a directory (ignored otherwise)
    tokenizer: str = "bytes"  # "bytes" (256 ids) | "bpe" (byte-level BPE trained on the train split; one for all [[data.mix]] sources) | hf:DIR (its tokenizer.json)
    vocab_size: int = 4096  # the vocabulary: BPE's size including <|endoftext|> (bpe), the token files' (format=tokens, e.g. 50257 for GPT-2); ignored for bytes (256) and hf:DIR (its own)
    val_fraction: float = 0.05  # share of documents held out for validation, chosen by a hash of each document
    seq_len: int = 256  # tokens per training sequence; targets are the inputs shifted by one
    cache_dir: str = ""  # where token shards are cached; "" = $KILN_CACHE, else ~/.cache/kiln
    seed: int = 1337  # seed of the batch sampling order (independent of the model's seed)
    prefetch: int = 2  # batches prepared ahead by a background thread on an accelerator (CPU: on demand); 0 = off
    workers: int = 0  # tokenizer processes of a prepare; 0 = one per CPU core. The shards are the same bytes for any count
    shard_tokens: int = 100_000_000  # tokens per shard file (uint8 for the bytes tokenizer, uint16 when the vocabulary fits, else uint32)
    tokenizer_sample_bytes: int = 100_000_000  # characters of train text, drawn from seeded pieces, that BPE trains on (bounds its memory); a [[data.mix]] shares them among its sources by weight
    on_bad_record: str = "error"  # error: stop at the first unreadable record, naming file and line | skip: skip it and count it in the summary
    mix: tuple = ()  # [[data.mix]] tables {source, weight, name, format, text_field, pattern}: a weighted mixture instead of data.source
    cache_per_node: bool = False  # multi-node: cache_dir is node-local, so each node's local rank 0 prepares it
    records: str = "text"  # text: each record is plain text (pretraining) | chat: `messages` [{role, content}] (system/user/assistant) or prompt/completion pairs, rendered with the chat template and packed whole into seq_len + 1 windows, a longer one skipped and counted (fine-tuning; kiln.data.sft, chat_data, packing)
    chat_template: str = ""  # records=chat: "" = the tokenizer's own (data.tokenizer=hf:DIR, or implied by model.init=hf:DIR) | chatml | PATH.jinja
    train_on: str = "assistant"  # records=chat: assistant (the loss counts every assistant turn's content and its end-of-turn token, not the role header; a completion) | all (every token); metrics.jsonl's loss_tokens counts them
    document_mask: bool | None = None  # attention and positions (RoPE, GPT-2's table) restart at every document in a window and a document's last target is not counted (text: documents end at the end-of-text id); None = true for records=chat, false for text. Not with parallel.pp > 1 or train.kernels=triton

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix for the first bad value."""
        if not self.source:
            raise KilnError(f"data.source is empty; give {sources()}",
                            key="data.source", value=self.source, fix=f"give {sources()}")
        if self.format not in FORMATS:
            raise KilnError(f"data.format={self.format!r} is unknown; use one of {FORMATS}",
                            key="data.format", value=self.format, fix=f"use one of {FORMATS}")
        if not self.text_field:
            raise KilnError("data.text_field is empty; name the JSONL field holding the text, e.g. 'text'",
                            key="data.text_field", value=self.text_field,
                            fix="name the JSONL field holding the text, e.g. 'text'")
        if not self.pattern:
            raise KilnError("data.pattern is empty; give a glob such as '**/*.txt'",
                            key="data.pattern", value=self.pattern, fix="give a glob such as '**/*.txt'")
        if self.tokenizer.startswith("hf:"):
            if not (Path(self.tokenizer[3:]) / TOKENIZER_FILE).is_file():
                raise KilnError(f"data.tokenizer={self.tokenizer!r}: {Path(self.tokenizer[3:]) / TOKENIZER_FILE} "
                                f"does not exist; give a Hugging Face model directory that holds one",
                                key="data.tokenizer", value=self.tokenizer,
                                fix="give a Hugging Face model directory that holds one")
        elif self.tokenizer not in TOKENIZERS:
            raise KilnError(f"data.tokenizer={self.tokenizer!r} is unknown; use one of {TOKENIZERS} or hf:DIR",
                            key="data.tokenizer", value=self.tokenizer, fix=f"use one of {TOKENIZERS} or hf:DIR")
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 2**32:
            raise KilnError(
                f"data.vocab_size={self.vocab_size} is out of range for bpe; it needs 256 byte tokens + "
                f"<|endoftext|>, so use at least 257 (4096-50304 is typical)",
                key="data.vocab_size", value=self.vocab_size, fix="use at least 257 (4096-50304 is typical)"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise KilnError(
                f"data.val_fraction={self.val_fraction} must be strictly between 0 and 1 (e.g. 0.05); "
                f"both splits need text",
                key="data.val_fraction", value=self.val_fraction, fix="give a fraction strictly between 0 and 1 (e.g. 0.05)"
            )
        if self.seq_len < 1:
            raise KilnError(f"data.seq_len={self.seq_len} must be >= 1 (e.g. 256)",
                            key="data.seq_len", value=self.seq_len, fix="give a length ≥ 1 (e.g. 256)")
        if self.seed < 0:
            raise KilnError(f"data.seed={self.seed} must be >= 0 (numpy seeds are non-negative)",
                            key="data.seed", value=self.seed, fix="give a seed ≥ 0")
        if self.prefetch < 0:
            raise KilnError(f"data.prefetch={self.prefetch} must be >= 0 (0 turns prefetching off)",
                            key="data.prefetch", value=self.prefetch, fix="give a count ≥ 0 (0 turns prefetching off)")
        if self.workers < 0:
            raise KilnError(f"data.workers={self.workers} must be >= 0 (0 = one per CPU core)",
                            key="data.workers", value=self.workers, fix="give a count ≥ 0 (0 = one per CPU core)")
        if self.shard_tokens < 1:
            raise KilnError(f"data.shard_tokens={self.shard_tokens} must be >= 1 (e.g. 100_000_000)",
                            key="data.shard_tokens", value=self.shard_tokens,
                            fix="give a count ≥ 1 (e.g. 100_000_000)")
        if self.tokenizer_sample_bytes < 1:
            raise KilnError(f"data.tokenizer_sample_bytes={self.tokenizer_sample_bytes} must be >= 1 (e.g. "
                            f"100_000_000)",
                            key="data.tokenizer_sample_bytes", value=self.tokenizer_sample_bytes,
                            fix="give a count ≥ 1 (e.g. 100_000_000)")
        if self.on_bad_record not in ON_BAD_RECORD:
            raise KilnError(f"data.on_bad_record={self.on_bad_record!r} is unknown; use one of {ON_BAD_RECORD}",
                            key="data.on_bad_record", value=self.on_bad_record, fix=f"use one of {ON_BAD_RECORD}")
        if self.format == "tokens" and not 2 <= self.vocab_size <= 2**32:
            raise KilnError(f"data.vocab_size={self.vocab_size}: with data.format=tokens it is the token files' "
                            f"vocabulary (e.g. 50257 for GPT-2)",
                            key="data.vocab_size", value=self.vocab_size,
                            fix="give the token files' vocabulary (e.g. 50257 for GPT-2)")
        if self.masks_documents and self.records == "text" and self.format == "tokens" \
                and not self.tokenizer.startswith("hf:"):
            raise KilnError("data.document_mask=true finds documents by their end-of-text id, which "
                            "data.format=tokens does not know without the files' tokenizer; give "
                            "--data.tokenizer=hf:DIR or set --data.document_mask=false",
                            key="data.document_mask", value=self.document_mask,
                            fix="give --data.tokenizer=hf:DIR or set --data.document_mask=false")
        if self.mix:
            check_mix(self)
        for one in [o for _, _, o in mix_sources(self)] if self.mix else [self]:
            check_chat(one)  # data.records, chat_template, train_on, document_mask (kiln.data.sft)

    @property
    def masks_documents(self) -> bool:
        """Whether windows carry their documents (kiln.data.documents): data.document_mask, or by records."""
        return self.records == "chat" if self.document_mask is None else bool(self.document_mask)
