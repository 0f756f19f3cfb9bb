"""data.document_mask on a pretraining corpus (kiln.data.documents): the documents of a random window come from the
separator token, counted here by hand; the loader and the validation batches carry them; the refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.config import ConfigError, load_config
from kiln.data import DataConfig
from kiln.data.documents import IGNORE_INDEX, document_separator, with_documents
from kiln.data.loader import TokenLoader, val_batches
from kiln.data.tokenizer import ByteTokenizer, IdsTokenizer
from kiln.models import transformer

SEP = 255


def test_ignore_index_is_the_models():
    assert IGNORE_INDEX == transformer.IGNORE_INDEX


def test_documents_by_hand():
    # the window starts inside a document; "SEP SEP" is an empty document; the window ends on a separator
    x = torch.tensor([[7, 8, SEP, 4, 5, 6, SEP, SEP, 9, SEP]])
    y = torch.tensor([[8, SEP, 4, 5, 6, SEP, SEP, 9, SEP, 3]])
    x2, y2, doc = with_documents(x, y, SEP)
    assert doc.dtype == torch.int32 and x2 is x
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3, 3]]
    assert y2.tolist() == [[8, SEP, -100, 5, 6, SEP, -100, -100, SEP, -100]]  # a document's end is still a target


def _hand(x_row: list[int]) -> list[int]:
    out, d = [], 0
    for tok in x_row:
        out.append(d)
        d += tok == SEP
    return out


def test_loader_and_val_batches_carry_documents():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 250, 4000).astype(np.uint8)
    tokens[rng.choice(4000, 200, replace=False)] = SEP  # documents of 20 tokens on average
    plain = TokenLoader(tokens, 4, 64, seed=3, prefetch=0)
    masked = TokenLoader(tokens, 4, 64, seed=3, prefetch=0, separator=SEP)
    threaded = TokenLoader(tokens, 4, 64, seed=3, prefetch=2, threaded=True, separator=SEP)
    for _ in range(3):
        (x, y), (x2, y2, doc), (x3, y3, doc3) = plain.next(), masked.next(), threaded.next()
        assert torch.equal(x, x2) and torch.equal(x2, x3) and torch.equal(y2, y3) and torch.equal(doc, doc3)
        assert doc.tolist() == [_hand(row) for row in x.tolist()]
        assert torch.equal(y2, torch.where(x == SEP, IGNORE_INDEX, y))
    assert (doc[:, -1] > 0).any()  # the windows do cross documents
    threaded.close()
    for (x, y), (x2, y2, doc) in zip(val_batches(tokens, 4, 64, 2), val_batches(tokens, 4, 64, 2, separator=SEP)):
        assert torch.equal(x, x2) and doc.tolist() == [_hand(row) for row in x.tolist()]
        assert torch.equal(y2, torch.where(x == SEP, IGNORE_INDEX, y))


def test_default_and_separator():
    assert not DataConfig().masks_documents and DataConfig(records="chat").masks_documents
    assert not DataConfig(records="chat", document_mask=False).masks_documents
    assert document_separator(DataConfig(document_mask=True), ByteTokenizer()) == 0xFF
    assert document_separator(DataConfig(), ByteTokenizer()) is None
    assert document_separator(DataConfig(records="chat"), ByteTokenizer()) is None  # chat packs its own documents
    with pytest.raises(ValueError, match="does not know; give --data.tokenizer=hf:DIR"):
        document_separator(DataConfig(document_mask=True), IdsTokenizer(50257))


@pytest.mark.parametrize("args, line", [
    (["--data.document_mask=true", "--train.kernels=triton"],
     "train.kernels=triton runs attention in FlashAttention, which takes no mask, and data.document_mask is on "
     "(records=text); use --train.kernels=torch, or set --data.document_mask=false"),
    (["--data.records=chat", "--data.chat_template=chatml", "--parallel.pp=2"],
     "parallel.pp=2 sends the pipeline stages hidden states, not the documents, and data.document_mask is on "
     "(records=chat); use --parallel.pp=1, or set --data.document_mask=false"),
    (["--data.format=tokens", "--data.document_mask=true"],
     "data.document_mask=true finds documents by their end-of-text id, which data.format=tokens does not know "
     "without the files' tokenizer; give --data.tokenizer=hf:DIR or set --data.document_mask=false"),
])
def test_refusals(args, line):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert str(e.value) == line


def test_context_parallelism_carries_the_document_mask():
    """parallel.cp > 1 shards the documents' positions and mask rows (kiln.parallel.context; the 2-rank run against
    one process is in tests/parallel/test_context_parallel.py): no refusal."""
    cfg = load_config(None, ["--data.document_mask=true", "--parallel.cp=2", "--parallel.strategy=fsdp"])
    assert cfg.data.masks_documents and cfg.parallel.cp == 2


def test_training_run_with_document_mask(tmp_path):
    """A real run's batches carry the documents and its loss goes through the mask (recompute on: doc passes)."""
    from kiln.run.lm import build_lm

    cfg = load_config(None, ["--data.document_mask=true", "--data.seq_len=64", "--model.max_seq_len=64",
                             "--train.micro_batch_size=2", "--memory.recompute=full"])
    lm = build_lm(cfg, tmp_path, log=lambda *a: None)
    batch = lm.state.loader.next()
    assert len(batch) == 3
    assert batch[2].tolist() == [[row[:t].count(0xFF) for t in range(64)] for row in batch[0].tolist()]
    loss = lm.state.objective(lm.state.model, batch)
    assert torch.isfinite(loss)
