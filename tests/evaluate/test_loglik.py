"""kiln.evaluate.loglik against references: transformers in float64 on kiln's exported model (tokenized by
transformers' own tokenizer, the harness's way), hand-worked rolling windows, and a direct sum."""
import pytest
import torch

from kiln.evaluate.loglik import Pair, encode_pair, loglikelihoods, rolling_loglikelihoods, rolling_windows
from kiln.parallel.layout import ParallelPlan
from kiln.run.source import load_source


LONG = "def heappush(heap, item):\n    heap.append(item)\n    _siftdown(heap, 0, len(heap) - 1)\n" * 2
REQUESTS = [("def f(x):\n    return", " x"), ("Question: which keyword? ", " def"), ("", " import os"),
            ("import sys\n", " é ünïcode"), (LONG, " pop")]  # LONG: more than the 32-token window


def reference(model, tokenizer, context: str, continuation: str, window: int) -> tuple[float, bool]:
    """The harness's request, written out: trailing spaces move to the continuation, the continuation's tokens
    are those of the whole after the context's, an empty context is the end-of-text id, the row keeps its last
    window + 1 tokens; transformers scores it alone, in float64."""
    if context:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        head = tokenizer.encode(context)
        cont = tokenizer.encode(context + continuation)[len(head):]
    else:
        head, cont = [tokenizer.eos_token_id], tokenizer.encode(continuation)
    whole = (head + cont)[-(window + 1):]
    with torch.no_grad():
        logp = model(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)
    n = len(cont)
    return sum(logp[len(whole) - 1 - n + j, cont[j]].item() for j in range(n)), len(head) + n > window + 1


@pytest.mark.parametrize("dtype, batch, tol", [(torch.float64, 1, 1e-9), (torch.float32, 3, 2e-4)],
                         ids=["fp64-one-at-a-time", "fp32-batched"])
def test_loglikelihoods_equal_transformers_float64(exported, hf, dtype, batch, tol):
    source = load_source(f"hf:{exported}", device="cpu", dtype=dtype)
    pairs = [encode_pair(source.tokenizer.encode, c, x, source.eot_id) for c, x in REQUESTS]
    lls, truncated = loglikelihoods(source.model, pairs, source.model_cfg.vocab_size, 32, batch_size=batch)
    want = [reference(*hf, c, x, 32) for c, x in REQUESTS]
    assert lls.dtype == torch.float64 and truncated == sum(t for _, t in want) == 1
    assert lls.tolist() == pytest.approx([w for w, _ in want], abs=tol, rel=0)


def test_encode_pair_moves_trailing_spaces_and_keeps_merges_across_the_boundary(exported):
    source = load_source(f"hf:{exported}", device="cpu")
    enc = source.tokenizer.encode
    pair = encode_pair(enc, "Answer:  ", "def", source.eot_id)  # two trailing spaces go to the continuation
    head = enc("Answer:")
    assert pair.context == tuple(head) and pair.continuation == tuple(enc("Answer:  def"))[len(head):]
    # a context ending inside a word: the continuation's tokens are the whole text's, not encode(continuation)
    whole, head = enc("import collections"), enc("import coll")
    assert encode_pair(enc, "import coll", "ections", 0).continuation == tuple(whole[len(head):])
    assert encode_pair(enc, "", " x", source.eot_id) == Pair((source.eot_id,), tuple(enc(" x")))
    assert encode_pair(lambda s: [7, 8], "", "ab", 7) == Pair((7,), (8,))  # it already starts with the prefix


def test_rolling_windows_as_worked_by_hand():
    """get_rolling_token_windows(context_len=1) + make_disjoint_window on tokens 1..10, window 4, prefix 0."""
    tokens = list(range(1, 11))
    assert rolling_windows(tokens, 0, 4) == [Pair((0,), (1, 2, 3, 4)), Pair((4,), (5, 6, 7, 8)),
                                             Pair((6, 7, 8), (9, 10))]
    assert rolling_windows(tokens[:4], 0, 4) == [Pair((0,), (1, 2, 3, 4))]
    assert rolling_windows(tokens[:5], 0, 4) == [Pair((0,), (1, 2, 3, 4)), Pair((1, 2, 3, 4), (5,))]
    assert rolling_windows(tokens[:2], 0, 4) == [Pair((0,), (1, 2))]
    assert rolling_windows([], 0, 4) == []
    for n in range(1, 30):  # every token predicted exactly once, in order, each row within the window + 1
        windows = rolling_windows(list(range(n)), -1, 7)
        assert [t for w in windows for t in w.continuation] == list(range(n))
        assert all(len(w.context) + len(w.continuation) <= 8 for w in windows)


def test_rolling_loglikelihood_is_the_direct_sum(exported, hf):
    """A document within the window: the sum of log p(token | end-of-text, every token before it), from one
    transformers forward in float64; a longer one: the sum of its windows' transformers log-likelihoods."""
    model, tokenizer = hf
    source = load_source(f"hf:{exported}", device="cpu", dtype=torch.float64)
    short, long = tokenizer.encode("x = [1, 2, 3]\nprint(x)"), tokenizer.encode(LONG)
    assert len(short) <= 32 < 2 * 32 < len(long)
    got = rolling_loglikelihoods(source.model, [short, long], source.eot_id, source.model_cfg.vocab_size, 32)
    with torch.no_grad():
        logp = model(torch.tensor([[tokenizer.eos_token_id] + short[:-1]])).logits[0].log_softmax(-1)
    direct = sum(logp[i, t].item() for i, t in enumerate(short))
    windows = rolling_windows(long, tokenizer.eos_token_id, 32)
    by_window = 0.0
    for w in windows:
        with torch.no_grad():
            lp = model(torch.tensor([list(w.context + w.continuation)[:-1]])).logits[0].log_softmax(-1)
        n = len(w.continuation)
        by_window += sum(lp[len(w.context) - 1 + j, t].item() for j, t in enumerate(w.continuation))
    assert got.tolist() == pytest.approx([direct, by_window], abs=1e-9, rel=0)


class Copy:
    """A data-parallel copy in one process: its rank, its layout (dp only), and an all-reduce that leaves its share
    as it is."""

    def __init__(self, rank, size):
        self.dp_rank, self.dp_size, self.size, self.plan = rank, size, size, ParallelPlan(size)

    def all_reduce(self, t, dim=None):
        return t


def test_split_over_copies_gives_every_row_once_with_equal_forwards(exported):
    source = load_source(f"hf:{exported}", device="cpu", dtype=torch.float64)
    enc = source.tokenizer.encode
    pairs = [encode_pair(enc, f"x{i} = {i} * {'y' * i}", f" {i}", source.eot_id) for i in range(7)]
    whole, _ = loglikelihoods(source.model, pairs, source.model_cfg.vocab_size, 32, batch_size=2)
    calls = []
    counting = source.model.register_forward_pre_hook(lambda module, args: calls.__setitem__(-1, calls[-1] + 1))
    shares = []
    for rank in range(3):  # 7 rows over 3 copies: 3, 2 + a dummy, 2 + a dummy; two forwards of 2 each
        calls.append(0)
        shares.append(loglikelihoods(source.model, pairs, source.model_cfg.vocab_size, 32, batch_size=2,
                                     world=Copy(rank, 3))[0])
    counting.remove()
    assert calls == [2, 2, 2]
    assert sum(shares).tolist() == pytest.approx(whole.tolist(), abs=1e-12, rel=0)
    assert [int((s != 0).sum()) for s in shares] == [3, 2, 2]
