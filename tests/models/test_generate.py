"""Generation with a KV cache (kiln.models.cache, kiln.models.generate) against the uncached model and against
transformers' own `generate` on the same weights, for every family; left-padded batches against each prompt
alone; top-p, top-k and temperature against transformers' logits warpers."""
import pytest
import torch

from kiln.models import ModelConfig, build_model
from kiln.models.generate import END, LENGTH, STOP, WINDOW, Sampling, generate, next_tokens, top_p_removed, warp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
from tests.interop.test_hf import _hf_model, _kiln  # noqa: E402  (after the skip: it needs transformers)

FAMILIES = ["gpt2", "llama", "qwen3", "qwen3_moe"]
POSITIONS = {"gpt2": {"n_positions": 80}}  # the others: max_position_embeddings


@pytest.fixture(autouse=True)
def one_thread():
    """One step of these models is a few small matmuls: on a shared 2-core machine two threads wait on each
    other (measured 2026-11-27, 2-core Xeon, load 4: 30 cached tokens of a 2-layer model 0.02 s on one thread,
    0.1-0.8 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", FAMILIES)
def test_cached_greedy_equals_uncached_and_transformers_generate(kind, tmp_path):
    """64 greedy tokens after an 8-token prompt: the cached logits are within 1e-5 of the uncached model's and of
    transformers' at every step (transformers runs its own KV cache), and the tokens are the same."""
    hf = _hf_model(kind, **POSITIONS.get(kind, {"max_position_embeddings": 80}))
    hf.generation_config.eos_token_id = None  # 64 tokens whatever is drawn (Llama's default eos is id 2)
    hf.save_pretrained(tmp_path / "hf")
    _, model = _kiln(tmp_path / "hf")
    V = hf.config.vocab_size
    prompt = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(1))
    cached = generate(model, prompt.tolist(), 64, vocab_limit=V, keep_logits=True)
    plain = generate(model, prompt.tolist(), 64, vocab_limit=V, keep_logits=True, use_cache=False)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=64, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    their_logits = torch.cat(theirs.logits)  # (64, V)
    ours = cached.logits[0]
    assert cached.reasons == [LENGTH] and len(cached.tokens[0]) == 64
    assert cached.tokens == plain.tokens == theirs.sequences[:, 8:].tolist()
    assert (ours - plain.logits[0]).abs().max().item() <= 1e-5
    assert (ours - their_logits).abs().max().item() <= 1e-5
    gaps = their_logits.topk(2).values
    assert (gaps[:, 0] - gaps[:, 1]).min().item() > 2e-5  # no tie within the tolerance: the argmax is determined


def _tiny(kind: str) -> ModelConfig:
    shape = dict(n_layer=2, n_head=4, d_model=64, max_seq_len=48, vocab_size=300)
    if kind == "gpt2":
        return ModelConfig(preset="tiny", **shape)
    extra = dict(n_kv_head=2, d_ff=96) | (dict(head_dim=24) if kind.startswith("qwen3") else {})
    if kind == "qwen3_moe":
        extra |= dict(n_experts=6, n_experts_active=2, moe_d_ff=32)
    return ModelConfig(preset="nano", arch=kind, **shape, **extra)


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_left_padded_batch_gives_each_prompt_what_it_gets_alone(kind):
    torch.manual_seed(0)
    model = build_model(_tiny(kind))
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (3, 11, 1, 7)]
    batch = generate(model, prompts, 16, vocab_limit=300, keep_logits=True)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], 16, vocab_limit=300, keep_logits=True)
        assert batch.tokens[i] == alone.tokens[0]
        assert (batch.logits[i] - alone.logits[0]).abs().max().item() <= 1e-5


def test_the_cache_stops_at_max_seq_len_and_the_sliding_window_goes_on():
    torch.manual_seed(0)
    model = build_model(_tiny("llama"))  # max_seq_len 48
    prompt = torch.randint(0, 300, (40,)).tolist()
    cached = generate(model, [prompt], 20, vocab_limit=300)
    plain = generate(model, [prompt], 20, vocab_limit=300, use_cache=False)
    # 48 positions hold the 40 prompt tokens and 8 generated ones; the 9th is predicted from the full window
    assert cached.reasons == [WINDOW] and len(cached.tokens[0]) == 9
    assert plain.reasons == [LENGTH] and plain.tokens[0][:9] == cached.tokens[0]
    # a prompt longer than the window keeps its last max_seq_len tokens, as the sliding window does
    long = torch.randint(0, 300, (60,)).tolist()
    assert generate(model, [long], 1, vocab_limit=300).tokens == generate(model, [long[-48:]], 1, vocab_limit=300).tokens


def test_stop_ids_and_stop_tests_end_a_row_and_are_not_kept():
    torch.manual_seed(0)
    model = build_model(_tiny("qwen3"))
    prompts = [[1, 2, 3], [4, 5]]
    free = generate(model, prompts, 12, vocab_limit=300)
    stop_at = free.tokens[0][5]
    first = free.tokens[0].index(stop_at)
    out = generate(model, prompts, 12, vocab_limit=300, stop_ids={stop_at})
    assert out.tokens[0] == free.tokens[0][:first] and out.reasons[0] == END
    # the caller's test (a stop string, in kiln.run.sample) sees the row's new tokens after each step
    out = generate(model, prompts, 12, vocab_limit=300, stop=lambda toks: len(toks) == 4)
    assert out.tokens == [t[:4] for t in free.tokens] and out.reasons == [STOP, STOP]


def _ties(g):
    """Random logits with ties at the nucleus boundary, -inf entries, one dominant token, all equal."""
    rows = [torch.randn(50, generator=g), torch.randn(50, generator=g).round(decimals=0),
            torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0, 0.0]).repeat(6), torch.zeros(50),
            torch.cat([torch.full((10,), -float("inf")), torch.randn(40, generator=g)]),
            torch.cat([torch.tensor([30.0]), torch.randn(49, generator=g)])]
    rows = [torch.nn.functional.pad(r, (0, 50 - len(r)), value=-1.0) for r in rows]
    return torch.stack(rows)


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0])
def test_top_p_removes_exactly_what_transformers_removes(p):
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    for logits in (_ties(g), torch.randn(64, 1000, generator=g) * 3):
        theirs = TopPLogitsWarper(p)(None, logits.clone()) == -float("inf")
        removed = top_p_removed(logits, p)
        assert torch.equal(removed | torch.isinf(logits), theirs)
        assert not removed.all(dim=-1).any()  # the likeliest token always stays
        if p == 1.0:
            assert not (removed & ~torch.isinf(logits)).any()


def test_warping_is_transformers_temperature_then_top_k_then_top_p():
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(0)) * 4
    for t, k, p in [(0.7, 50, 0.9), (1.3, 5, 0.5), (1.0, 0, 0.8), (0.5, 200, 1.0), (2.0, 1, 0.3)]:
        steps = [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(p)]
                                                                                       if p < 1 else [])
        theirs = LogitsProcessorList(steps)(None, logits.clone())
        assert torch.equal(warp(logits, Sampling(t, k, p)), theirs)


def test_sampling_draws_only_kept_tokens_and_repeats_with_its_seed():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    s = Sampling(temperature=0.9, top_k=20, top_p=0.6)
    kept = warp(logits, s) > -float("inf")
    draws = [next_tokens(logits, s, torch.Generator().manual_seed(i)) for i in range(200)]
    assert all(kept[torch.arange(4), d].all() for d in draws)
    assert len({tuple(d.tolist()) for d in draws}) > 1  # it samples, not argmax
    again = next_tokens(logits, s, torch.Generator().manual_seed(7))
    assert torch.equal(again, draws[7])
    assert torch.equal(next_tokens(logits, Sampling(temperature=1.0, top_k=1)), logits.argmax(-1))
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=1.5)
