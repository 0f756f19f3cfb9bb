"""`kiln data show`: the batches the model will see, decoded, inputs over targets column by column, and the data's
statistics. A shift error, a tokenizer that splits oddly or a corpus that is mostly whitespace is visible at once.

Cells: each token decoded on its own, whitespace made visible (· space, ⏎ newline, ⇥ tab), ⟂ the end-of-document
token (a document boundary), ∅ a target the loss ignores (a prompt token under data.train_on=assistant, a document's
last target under data.document_mask, padding): every other target is counted, and each row says how many. Inputs and targets of one position share a column: when
the data is right, each target is the next column's input.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from kiln.data import TokenLoader, prepare_data
from kiln.models import IGNORE_INDEX

VISIBLE = {" ": "·", "\n": "⏎", "\t": "⇥", "\r": "␍"}
EOT, IGNORED = "⟂", "∅"


@dataclass
class DataStats:
    documents: int
    train_tokens: int
    val_tokens: int
    vocab_size: int
    used: int  # distinct token ids in the train split
    top: list[tuple[str, float]]  # (token, share of the train split), most frequent first

    def lines(self) -> list[str]:
        total = self.train_tokens + self.val_tokens
        return [f"documents {self.documents:,} | tokens {total:,} (train {self.train_tokens:,}, val "
                f"{self.val_tokens:,}) | {total / max(self.documents, 1):,.0f} tokens per document",
                f"vocabulary used {self.used:,} of {self.vocab_size:,} ({self.used / self.vocab_size:.1%}) | most "
                f"frequent: " + ", ".join(f"{tok} {share:.1%}" for tok, share in self.top)]


def cell(tokenizer, token: int) -> str:
    if token == IGNORE_INDEX:
        return IGNORED
    if token == tokenizer.eot_id:
        return EOT
    text = tokenizer.decode([int(token)])
    return "".join(VISIBLE.get(ch, ch) for ch in text) or "∅"


def aligned(tokenizer, inputs, targets, width: int = 110) -> list[str]:
    """Inputs over targets, one column per position, wrapped at `width` characters."""
    ins = [cell(tokenizer, t) for t in inputs]
    outs = [cell(tokenizer, t) for t in targets]
    lines, row_in, row_out, used = [], "  in  │", "  tgt │", 7
    for i, (a, b) in enumerate(zip(ins, outs)):
        w = max(len(a), len(b))
        if used + w + 1 > width:
            lines += [row_in, row_out, ""]
            row_in, row_out, used = "  in  │", "  tgt │", 7
        row_in += a.ljust(w) + "│"
        row_out += b.ljust(w) + "│"
        used += w + 1
    return lines + [row_in, row_out]


def statistics(data) -> DataStats:
    parts = [part for _, _, part in data.sources] if data.sources else [data]  # a mixture: each source's cache
    documents = sum(json.loads((part.cache_dir / "meta.json").read_text())["docs"] for part in parts)
    counts = np.zeros(data.tokenizer.vocab_size, dtype=np.int64)
    for train in [p.train for p in parts]:
        flat = train.content() if hasattr(train, "content") else train  # chat: its windows less their padding
        for start in range(0, len(flat), 1 << 24):
            counts += np.bincount(flat[start:start + (1 << 24)], minlength=data.tokenizer.vocab_size)
    top = np.argsort(-counts)[:8]
    train_tokens, val_tokens = (sum(len(p.content()) if hasattr(p, "content") else len(p) for p in split)
                                for split in ([p.train for p in parts], [p.val for p in parts]))
    return DataStats(documents=documents, train_tokens=train_tokens, val_tokens=val_tokens,
                     vocab_size=data.tokenizer.vocab_size, used=int((counts > 0).sum()),
                     top=[(cell(data.tokenizer, int(t)), counts[t] / counts.sum()) for t in top if counts[t]])


def show(cfg, batches: int = 1, rows: int = 2, positions: int = 48, log=print) -> list[str]:
    """The data's statistics and the first `rows` rows of the first `batches` training batches, as printed."""
    data = prepare_data(cfg.data, None, log=log)
    loader = TokenLoader(data.train, cfg.train.micro_batch_size, cfg.data.seq_len, cfg.data.seed, "cpu", prefetch=0)
    lines = statistics(data).lines()
    lines.append(f"{EOT} end of document, {IGNORED} ignored target, · space, ⏎ newline; when the data is right each "
                 f"target is the next column's input")
    try:
        for b in range(batches):
            x, y, *doc = loader.next()  # doc: the document mask's (packed chat windows, data.document_mask)
            lines.append(f"batch {b + 1} ({cfg.train.micro_batch_size} × {cfg.data.seq_len} tokens), the first "
                         f"{min(positions, cfg.data.seq_len)} positions of {min(rows, len(x))} rows:")
            for r in range(min(rows, len(x))):
                docs = f", {int(doc[0][r].max()) + 1} documents" if doc else ""
                lines.append(f" row {r}: the loss counts {int((y[r] != IGNORE_INDEX).sum())} of {len(y[r])} targets "
                             f"(the others {IGNORED}){docs}")
                lines += aligned(data.tokenizer, x[r, :positions].tolist(), y[r, :positions].tolist())
    finally:
        loader.close()
    return lines
