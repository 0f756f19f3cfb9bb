"""TokenLoader (random training windows, exact resume) and val_batches (fixed windows)."""
import gc
import random
import threading
import time

import numpy as np
import pytest
import torch

from kiln.data.loader import TokenLoader, val_batches

# Token i has value i, so a window's contents reveal where it starts.
TOKENS = np.arange(10_000, dtype=np.uint32)
B, T = 4, 16


def take(loader, n):
    return [loader.next() for _ in range(n)]


def assert_same(batches, others):
    assert len(batches) == len(others)
    for (x, y), (x2, y2) in zip(batches, others):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "kiln-token-loader"]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_are_contiguous_windows_with_shifted_targets(prefetch):
    with TokenLoader(TOKENS, B, T, seed=0, prefetch=prefetch, threaded=True) as loader:
        for x, y in take(loader, 10):
            assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
            assert x.is_contiguous() and y.is_contiguous()
            assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
            assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(B, T - 1, dtype=torch.int64))  # contiguous
            assert torch.equal(y[:, -1], x[:, -1] + 1)
            assert x.min() >= 0 and y.max() < len(TOKENS)


def test_windows_cover_the_whole_array_including_both_ends():
    tokens = np.arange(T + 3, dtype=np.uint16)  # 3 possible starts: 0, 1, 2
    with TokenLoader(tokens, 64, T, seed=0, prefetch=0) as loader:
        starts = set(loader.next()[0][:, 0].tolist())
    assert starts == {0, 1, 2}


def test_same_seed_same_batches_other_seed_differs():
    with TokenLoader(TOKENS, B, T, seed=3) as a, TokenLoader(TOKENS, B, T, seed=3) as b:
        with TokenLoader(TOKENS, B, T, seed=4) as c:
            first, second, third = take(a, 5), take(b, 5), take(c, 5)
    assert_same(first, second)
    assert not torch.equal(first[0][0], third[0][0])


def test_prefetch_does_not_change_the_stream():
    with (TokenLoader(TOKENS, B, T, seed=1, prefetch=0) as a,
          TokenLoader(TOKENS, B, T, seed=1, prefetch=3, threaded=True) as b):
        assert_same(take(a, 8), take(b, 8))


def test_resume_from_state_dict_is_exact_with_prefetch():
    reference = TokenLoader(TOKENS, B, T, seed=7, prefetch=2, threaded=True)
    take(reference, 5)
    time.sleep(0.05)  # let the prefetcher run ahead: its queued batches must not count as served
    state = reference.state_dict()
    assert state["batches_served"] == 5 and state["seed"] == 7
    expected = take(reference, 6)
    reference.close()

    resumed = TokenLoader(TOKENS, B, T, seed=7, prefetch=2, threaded=True)
    take(resumed, 2)  # a fresh loader that already moved (and prefetched) elsewhere
    resumed.load_state_dict(state)
    assert_same(take(resumed, 6), expected)
    assert resumed.state_dict()["batches_served"] == 11
    resumed.close()


def test_skip_equals_consuming():
    with TokenLoader(TOKENS, B, T, seed=2) as a, TokenLoader(TOKENS, B, T, seed=2) as b:
        take(a, 7)
        take(b, 2)
        b.skip(5)
        assert b.state_dict()["batches_served"] == 7
        assert_same(take(a, 3), take(b, 3))
        b.skip(0)
        assert_same(take(a, 1), take(b, 1))
        with pytest.raises(ValueError, match="n=-1"):
            b.skip(-1)


def test_load_state_dict_refuses_a_different_stream():
    with TokenLoader(TOKENS, B, T, seed=2, prefetch=0) as loader:
        state = loader.state_dict()
    with TokenLoader(TOKENS, B, T, seed=9, prefetch=0) as other:
        with pytest.raises(ValueError, match="seed=2 but this loader has seed=9"):
            other.load_state_dict(state)
    with TokenLoader(TOKENS, B + 1, T, seed=2, prefetch=0) as other:
        with pytest.raises(ValueError, match="batch_size"):
            other.load_state_dict(state)


def test_global_rng_streams_are_untouched():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with TokenLoader(TOKENS, B, T, seed=5, prefetch=2, threaded=True) as loader:
        take(loader, 5)
        loader.skip(3)
        take(loader, 2)
    list(val_batches(TOKENS, B, T, max_batches=3))
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert random.getstate() == before[2]


def test_too_few_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="16 tokens are fewer than seq_len \\+ 1 = 17"):
        TokenLoader(np.arange(16), B, T, seed=0)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        list(val_batches(np.arange(16), B, T, max_batches=1))
    TokenLoader(np.arange(17), B, T, seed=0, prefetch=0).close()  # exactly seq_len + 1 is enough


def test_a_cpu_device_loader_starts_no_thread_and_gives_the_same_stream():
    # On a CPU device a producer thread would compete with the step's compute threads for the same cores.
    with (TokenLoader(TOKENS, B, T, seed=3, device="cpu", prefetch=2) as inline,
          TokenLoader(TOKENS, B, T, seed=3, device="cpu", prefetch=2, threaded=True) as threaded):
        a, b = take(inline, 4), take(threaded, 4)
        assert not inline.threaded and inline._thread is None
        assert threaded._thread is not None
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_close_stops_the_thread_and_dropped_loaders_are_collected():
    loader = TokenLoader(TOKENS, B, T, seed=0, prefetch=2, threaded=True)
    loader.next()
    assert loader_threads()
    loader.close()
    loader.close()  # idempotent
    assert not loader_threads()
    loader = TokenLoader(TOKENS, B, T, seed=0, prefetch=2, threaded=True)
    del loader
    gc.collect()
    assert not loader_threads()


def test_val_batches_are_fixed_nonoverlapping_and_spread():
    first = list(val_batches(TOKENS, B, T, max_batches=5))
    assert_same(first, list(val_batches(TOKENS, B, T, max_batches=5)))
    assert len(first) == 5
    x = torch.cat([b[0] for b in first])
    y = torch.cat([b[1] for b in first])
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    starts = x[:, 0]
    assert torch.all(starts % T == 0)  # aligned windows ...
    assert torch.all(starts[1:] - starts[:-1] >= T)  # ... that never overlap, in order
    assert starts[0] == 0 and starts[-1] > 0.9 * len(TOKENS)  # spread over the whole split


def test_val_batches_stop_when_the_split_runs_out():
    tokens = np.arange(5 * T + 1)  # exactly 5 windows
    batches = list(val_batches(tokens, 2, T, max_batches=100))
    assert [len(b[0]) for b in batches] == [2, 2, 1]
    assert torch.cat([b[0] for b in batches])[:, 0].tolist() == [0, T, 2 * T, 3 * T, 4 * T]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_match_cpu():
    cpu = TokenLoader(TOKENS, B, T, seed=1, device="cpu")
    with cpu, TokenLoader(TOKENS, B, T, seed=1, device="cuda") as gpu:
        for (x, y), (gx, gy) in zip(take(cpu, 4), take(gpu, 4)):
            assert gx.is_cuda and gy.is_cuda
            assert torch.equal(x, gx.cpu()) and torch.equal(y, gy.cpu())
        gpu.skip(2)
        cpu.skip(2)
        assert torch.equal(cpu.next()[0], gpu.next()[0].cpu())
