"""Data: text source -> documents -> train/val split -> tokenizer -> cached token shards -> batches.

    prepare_data(cfg.data, run_dir)      tokenize once into shards under the cache, or reuse them
    TokenLoader(prepared.train, ...)     seeded, resumable random windows for training
    val_batches(prepared.val, ...)       fixed windows for validation

Every document is followed by the tokenizer's end-of-text id (see tokenizer.py), so the model sees where one
file ends and the next begins; windows are sampled across those boundaries like GPT-2's.

The modules by concern: config (DataConfig), prepared (prepare_data, PreparedData), cache (where shards live and
what keys them), build (tokenizing into shards), summary (the lines a prepare logs), prepare (pieces, workers,
resume), loader (batches), tokenizer, corpus, mix, shards, pretokenized; chat, sft, chat_data, packing for chat
records; jsonl (the one JSONL line reader: chat sources, prompt files, task files).
"""
from __future__ import annotations

from kiln.data.build import mix_sample_shares
from kiln.data.cache import PIPELINE_VERSION, cache_dir_for, cache_key, cache_root
from kiln.data.config import FORMATS, ON_BAD_RECORD, TOKENIZERS, DataConfig
from kiln.data.corpus import CorpusError
from kiln.data.loader import TokenLoader, val_batches
from kiln.data.mix import Mixture
from kiln.data.prepared import PreparedData, cached_unigram_loss, prepare_data
from kiln.data.shards import ShardError
from kiln.data.summary import progress_line, summary_line, unigram_entropy
from kiln.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "DataConfig", "PreparedData", "prepare_data", "Tokenizer", "ByteTokenizer", "BPETokenizer", "load_tokenizer",
    "TokenLoader", "val_batches", "ShardError", "CorpusError", "unigram_entropy", "cache_root", "cache_dir_for",
    "cached_unigram_loss", "Mixture", "progress_line", "summary_line", "cache_key", "mix_sample_shares",
    "FORMATS", "ON_BAD_RECORD", "TOKENIZERS", "PIPELINE_VERSION",
]
