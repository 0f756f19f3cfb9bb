"""Weighted mixtures of sources: `[[data.mix]]` tables, and the sampler that draws each batch's rows from them.

Row r of training batch i comes from source s with probability weight_s / sum(weights), drawn with
np.random.default_rng([seed, i]) like the single-source sampler's windows: a batch is a pure function of
(seed, batch index), so resuming is exact and the data order does not depend on the world size. A window never
crosses from one source into another.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from kiln.data.corpus import STDLIB
from kiln.data.shards import ShardedTokens
from kiln.errors import KilnError

MIX_KEYS = ("source", "weight", "name", "format", "text_field", "pattern", "records")


def source_name(source: str) -> str:
    """The name a source's metrics carry: the file or directory name without its extensions (b.jsonl.gz -> b)."""
    name = Path(source).expanduser().name or "data"
    return name.split(".")[0] or name


def check_mix(cfg) -> None:
    """Raise ValueError naming the [[data.mix]] entry and the fix for the first bad one."""
    if cfg.source != STDLIB:
        raise KilnError(f"data.source={cfg.source!r} and [[data.mix]] are both set; give one: move the source into "
                        f"a [[data.mix]] table, or drop the mixture",
                        key="data.source", value=cfg.source,
                        fix="move the source into a [[data.mix]] table, or drop the mixture")
    names = []
    for i, entry in enumerate(cfg.mix):
        where = f"[[data.mix]] entry {i + 1}"
        if not isinstance(entry, dict):
            raise KilnError(f"{where} is {entry!r}; each entry is a table such as {{source = \"a.jsonl\", weight = 1}}",
                            key="data.mix", value=entry,
                            fix="each entry is a table such as {source = \"a.jsonl\", weight = 1}")
        unknown = sorted(set(entry) - set(MIX_KEYS))
        if unknown:
            raise KilnError(f"{where}: unknown key(s) {unknown}; the keys are {list(MIX_KEYS)}",
                            key="data.mix", value=unknown, fix=f"the keys are {list(MIX_KEYS)}")
        if not isinstance(entry.get("source"), str) or not entry["source"]:
            raise KilnError(f"{where} has no source; add source = \"path/to/data\"",
                            key="data.mix", value=entry, fix="add source = \"path/to/data\"")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise KilnError(f"{where}: weight={weight!r} must be a number > 0",
                            key="data.mix", value=weight, fix="give a weight > 0")
        for key in ("name", "format", "text_field", "pattern", "records"):
            if key in entry and not isinstance(entry[key], str):
                raise KilnError(f"{where}: {key}={entry[key]!r} must be a string",
                                key="data.mix", value=entry[key], fix=f"give {key} as a string")
        names.append(entry.get("name") or source_name(entry["source"]))
    if cfg.tokenizer == "bpe" and any(e.get("format", cfg.format) == "tokens" for e in cfg.mix):
        raise KilnError("data.tokenizer=bpe with a data.format=tokens source in [[data.mix]]: token files are read "
                        "as they are, so a new vocabulary cannot apply to them; give the mixture the files' tokenizer "
                        "(hf:DIR)",
                        key="data.tokenizer", value=cfg.tokenizer,
                        fix="give the mixture the files' tokenizer (hf:DIR)")
    kinds = sorted({e.get("records", cfg.records) for e in cfg.mix if isinstance(e, dict)})
    if len(kinds) > 1:
        raise KilnError(f"[[data.mix]] mixes records {kinds}: chat windows carry a loss mask and document "
                        f"boundaries that text windows do not; give every source the same records",
                        key="data.mix", value=kinds, fix="give every source the same records")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise KilnError(f"[[data.mix]]: the name(s) {dupes} are used twice (names default to the file name without "
                        f"extensions); give each entry its own name = \"...\"",
                        key="data.mix", value=dupes, fix="give each entry its own name = \"...\"")


def mix_sources(cfg) -> list[tuple[str, float, object]]:
    """(name, weight, DataConfig of that source alone) for each [[data.mix]] entry."""
    out = []
    for entry in cfg.mix:
        one = replace(cfg, mix=(), source=entry["source"], format=entry.get("format", cfg.format),
                      text_field=entry.get("text_field", cfg.text_field), pattern=entry.get("pattern", cfg.pattern),
                      records=entry.get("records", cfg.records))
        out.append((entry.get("name") or source_name(entry["source"]), float(entry.get("weight", 1.0)), one))
    return out


class Mixture(ShardedTokens):
    """The sources' training tokens: indexable as their concatenation (statistics, `len`), sampled by weight."""

    def __init__(self, names: list[str], weights: list[float], arrays: list) -> None:
        super().__init__([p for a in arrays for p in (a.parts if isinstance(a, ShardedTokens) else [a])])
        self.names, self.arrays = names, arrays
        total = sum(weights)
        self.weights = np.array([w / total for w in weights])

    def check_length(self, seq_len: int, what: str) -> None:
        for name, tokens in zip(self.names, self.arrays):
            if len(tokens) < seq_len + 1:
                raise KilnError(f"{what}: source {name!r} holds {len(tokens)} tokens, fewer than seq_len + 1 = "
                                f"{seq_len + 1}; lower data.seq_len or give it more text", key="data.seq_len",
                                value=seq_len, fix="lower data.seq_len or give it more text")

    def windows(self, seed: int, index: int, batch_size: int, seq_len: int) -> np.ndarray:
        """(batch_size, seq_len + 1) token windows of training batch `index`."""
        rng = np.random.default_rng([seed, index])
        source = rng.choice(len(self.arrays), size=batch_size, p=self.weights)
        u = rng.random(batch_size)
        rows = np.empty((batch_size, seq_len + 1), dtype=np.int64)
        offsets = np.arange(seq_len + 1)
        for s in np.unique(source):
            mine = source == s
            tokens = self.arrays[s]
            starts = (u[mine] * (len(tokens) - seq_len)).astype(np.int64)  # uniform in [0, len - seq_len - 1]
            rows[mine] = tokens[starts[:, None] + offsets]
        return rows
