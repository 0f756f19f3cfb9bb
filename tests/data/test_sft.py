"""Instruction data (kiln.data.sft, chat_data, packing): token ids against transformers' apply_chat_template for a
Qwen3-style and a Llama-3-style template written here, the prompt mask against transformers'
return_assistant_tokens_mask and against a hand count, packing against the samples alone, the cache, the loader's
order and resume, and the refusals. Nothing is downloaded: the tokenizer is trained here."""
import json

import numpy as np
import pytest
import torch

from kiln.data import DataConfig, TokenLoader, prepare_data, val_batches
from kiln.data.chat_data import chat_cache_dir
from kiln.data.packing import IGNORE_INDEX, PackedWindows, pack
from kiln.data.sft import ChatRecordError, Template, chat_template_for, conversation, encode_sample
from kiln.data.tokenizer import BPETokenizer, ByteTokenizer
from kiln.errors import KilnError
from kiln.models import IGNORE_INDEX as MODEL_IGNORE

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")

# Qwen3's shape: ChatML, {% generation %} around what the assistant writes, and the reasoning shown on the last turn
# only (which is why it needs the generation blocks: its prefixes are not prefixes of the whole).
QWEN3 = """{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}
{%- if loop.last and message.reasoning_content is defined %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
QWEN3_PLAIN = QWEN3.replace("{% generation %}", "").replace("{% endgeneration %}", "")
LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  2+2? "},
     {"role": "assistant", "content": "four "}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "six, café \U0001f600"}],
    [{"role": "user", "content": "Reverse 'abc'"}, {"role": "assistant", "content": "cba", "reasoning_content": "a b c"}],
]
REPLIES = [["4"], ["four ", "six, café \U0001f600"], ["cba"]]  # each chat's assistant contents


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([json.dumps(CHATS) * 20, QWEN3, LLAMA3], trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    dirs = {}
    for name, template, eos in (("qwen3", QWEN3, "<|im_end|>"), ("llama3", LLAMA3, "<|eot_id|>"),
                                ("plain", QWEN3_PLAIN, "<|im_end|>"), ("none", None, "<|endoftext|>")):
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                    eos_token=eos, pad_token="<|endoftext|>")
        if template is not None:
            fast.chat_template = template
        dirs[name] = tmp_path_factory.mktemp(name)
        fast.save_pretrained(dirs[name])
    return dirs


def _setup(directory, **data):
    cfg = DataConfig(tokenizer=f"hf:{directory}", records="chat", **data)
    return chat_template_for(cfg), BPETokenizer.from_hf(directory)


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_ids_and_mask_equal_transformers_and_a_hand_count(tokenizer_dirs, name):
    template, tok = _setup(tokenizer_dirs[name])
    assert template.generation == (name == "qwen3")  # qwen3: spans from the blocks; llama3: from prefixes
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dirs[name])
    end = "<|im_end|>" if name == "qwen3" else "<|eot_id|>"
    for chat, replies in zip(CHATS, REPLIES):
        ids, mask = encode_sample(conversation({"messages": chat}, "t"), template, tok, "assistant", "t")
        assert ids.tolist() == hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        if name == "qwen3":  # the same tokens as transformers' own mask
            out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            assert mask.astype(int).tolist() == out["assistant_masks"]
        # by hand: the counted tokens spell each reply (llama3 trims it; qwen3 shows the last turn's reasoning) and
        # its end-of-turn token, and nothing of the headers
        think = {"qwen3": "<think>\na b c\n</think>\n\n"}.get(name, "") if "reasoning_content" in chat[-1] else ""
        want = "".join((think if i == len(replies) - 1 else "") + (r.strip() if name == "llama3" else r) + end
                       for i, r in enumerate(replies))
        assert tok.decode(ids[mask].tolist()) == want
        _, everything = encode_sample(chat, template, tok, "all", "t")
        assert everything.all()


def test_prompt_completion_counts_the_completion(tokenizer_dirs):
    template, tok = _setup(tokenizer_dirs["llama3"])
    ids, mask = encode_sample(conversation({"prompt": "Sum 2 and 3", "completion": "5"}, "t"), template, tok,
                              "assistant", "t")
    assert tok.decode(ids[mask].tolist()) == "5<|eot_id|>"
    assert tok.decode(ids.tolist()).startswith("<|begin_of_text|><|start_header_id|>user")


def test_a_template_without_prefixes_is_refused(tokenizer_dirs):
    template, tok = _setup(tokenizer_dirs["plain"])
    encode_sample(CHATS[2], template, tok, "assistant", "f.jsonl:3")  # one turn: its prefix is the whole
    with pytest.raises(KilnError, match=r"f.jsonl:2: the chat template .* does not render message 1's prefix .* "
                                        r"\{% generation %\}.* data.train_on=all"):
        encode_sample(CHATS[2] + [{"role": "user", "content": "x"}], template, tok, "assistant", "f.jsonl:2")
    encode_sample(CHATS[1], template, tok, "all", "f.jsonl:2")  # train_on=all needs no spans


@pytest.mark.parametrize("record, words", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}, "role 'tool'"),
    ({"text": "plain"}, "no \"messages\" and no \"prompt\"/\"completion\""),
    ({"messages": [{"role": "user", "content": 3}]}, "no string \"content\""),
])
def test_bad_records_name_the_line(record, words):
    with pytest.raises(ChatRecordError, match=f"a.jsonl:7: .*{words}"):
        conversation(record, "a.jsonl:7")


def test_a_template_that_refuses_a_record_names_its_line(tokenizer_dirs):
    template = Template("{% if messages[0].role != 'user' %}{{ raise_exception('first comes the user') }}{% endif %}"
                        "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ChatRecordError, match=r"f.jsonl:4: the chat template: first comes the user; fix the record"):
        encode_sample([{"role": "assistant", "content": "x"}], template, ByteTokenizer(), "all", "f.jsonl:4")
    broken = Template("{% for m in messages %}{{ m.content + 3 }}{% endfor %}")
    with pytest.raises(ChatRecordError, match=r"f.jsonl:5: the chat template fails on it \(TypeError: "):
        encode_sample([{"role": "assistant", "content": "x"}], broken, ByteTokenizer(), "all", "f.jsonl:5")


def test_every_container_gives_the_same_windows(tmp_path, tokenizer_dirs):
    import gzip

    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (the data extra has it)")
    import pyarrow as pa

    rows = _records(30)
    plain = _write(tmp_path / "c.jsonl", rows)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    table = pa.Table.from_batches([pa.RecordBatch.from_struct_array(pa.array(rows))])  # every row's columns
    pq.write_table(table, tmp_path / "c.parquet")
    got = []
    for name in ("c.jsonl", "c.jsonl.gz", "c.parquet"):
        cfg = DataConfig(source=str(tmp_path / name), tokenizer=f"hf:{tokenizer_dirs['llama3']}", records="chat",
                         seq_len=64, cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
        data = prepare_data(cfg, log=lambda m: None)
        got.append([np.asarray(a).tolist() for a in (data.train.tokens, data.train.mask, data.val.tokens)])
    assert got[0] == got[1] == got[2]


def test_pack_is_the_samples_alone():
    rng = np.random.default_rng(0)
    samples = [(rng.integers(1, 50, n), rng.random(n) < 0.5) for n in (5, 9, 3, 17, 4, 12, 30, 6)]
    tokens, mask, doc, placed = pack(samples, seq_len=15, pad_id=0, dtype=np.int64)
    assert placed == [0, 1, 2, 4, 5, 7]  # 17 and 30 > 16 tokens: skipped, counted by the caller
    assert len(tokens) == 3  # first fit: 5+9 | 3+4+6 (the 6 goes back to the window with room) | 12
    assert (np.diff(doc, axis=1) >= 0).all() and (doc[:, 0] == 0).all()
    for masked in (True, False):
        x, y, *d = PackedWindows(tokens, mask, doc, masked).rows(np.arange(len(tokens)))
        assert len(d) == masked
        found, left = 0, list(placed)
        for w in range(len(tokens)):
            for k in np.unique(doc[w]):
                at = np.flatnonzero(doc[w] == k)
                if k == doc[w, -1] and tokens[w, at].sum() == 0:
                    assert (y[w, at[at < 15]] == IGNORE_INDEX).all()  # padding never counts
                    continue
                match = [i for i in left if samples[i][0].tolist() == tokens[w, at].tolist()]
                assert match and (k == 0 or match[0] > last)  # a placed sample; file order within a window
                last = match[0]
                left.remove(match[0])
                ids, counted = samples[match[0]]
                found += 1
                assert tokens[w, at].tolist() == ids.tolist()
                inside = at[:-1]  # positions whose target is the sample's next token
                want = np.where(counted[1:], ids[1:], IGNORE_INDEX)
                assert y[w, inside].tolist() == want.tolist()
                if at[-1] < 15 and masked:  # the sample's last position: its target opens the next sample
                    assert y[w, at[-1]] == IGNORE_INDEX
        assert found == len(placed)
    assert IGNORE_INDEX == MODEL_IGNORE


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _records(n):
    rows = []
    for i in range(n):
        a, b = i % 10, (i * 7) % 10
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}?"},
                                  {"role": "assistant", "content": str(a + b)}]} if i % 2 else
                    {"prompt": f"reverse {a}{b}", "completion": f"{b}{a}"})
    return rows


def test_prepare_caches_packs_and_refuses(tmp_path, tokenizer_dirs):
    source = _write(tmp_path / "chat.jsonl", _records(60))
    cfg = DataConfig(source=str(source), tokenizer=f"hf:{tokenizer_dirs['qwen3']}", records="chat", seq_len=64,
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    lines = []
    data = prepare_data(cfg, log=lines.append)
    assert any("chat summary: 60 conversations" in line for line in lines)
    meta = json.loads((data.cache_dir / "meta.json").read_text())
    assert meta["train_docs"] + meta["val_docs"] == 60 and meta["val_docs"] > 0 and meta["too_long"] == 0
    assert 0 < meta["train_counted"] < meta["train_tokens"]
    x, y, doc = next(iter(TokenLoader(data.train, 4, 64, 0, prefetch=0)))
    assert x.dtype == y.dtype == torch.int64 and doc.dtype == torch.int32 and x.shape == doc.shape == (4, 64)
    again = []
    prepare_data(cfg, log=again.append)
    assert any("cached at" in line for line in again) and not any("summary" in line for line in again)
    for change in ({"train_on": "all"}, {"seq_len": 32}, {"chat_template": "chatml"}):  # each in the cache key
        assert chat_cache_dir(DataConfig(**{**vars(cfg), **change}), tmp_path) != chat_cache_dir(cfg, tmp_path)
    # a bad line: refused naming file:line, nothing left behind; skipped and counted when asked
    bad = _write(tmp_path / "bad.jsonl", _records(10) + ['{"messages": [{"role": "user", "content": "hi"}]}',
                                                         "not json"])
    broken = DataConfig(**{**vars(cfg), "source": str(bad)})
    with pytest.raises(ChatRecordError, match=r"bad.jsonl:11: no assistant turn"):
        prepare_data(broken, log=lambda m: None)
    assert [p.suffix for p in (tmp_path / "cache").glob("bad*")] == [".lock"]  # neither a cache nor its .partial
    skipped = []
    data = prepare_data(DataConfig(**{**vars(broken), "on_bad_record": "skip"}), log=skipped.append)
    assert any("2 bad records skipped" in line for line in skipped)
    assert any("bad.jsonl:12: not a JSON object" in line for line in skipped)
    long = _write(tmp_path / "long.jsonl", _records(10) + [json.dumps({"prompt": "x " * 40, "completion": "y"})])
    short = []
    prepare_data(DataConfig(**{**vars(cfg), "source": str(long), "seq_len": 24}), log=short.append)
    assert any("| 1 longer than a window skipped" in line for line in short), short


def test_loader_order_is_seeded_epochs_and_resumes(tmp_path):
    rng = np.random.default_rng(1)
    tokens, mask, doc, _ = pack([(rng.integers(1, 9, 8), np.ones(8, bool)) for _ in range(40)], 15, 0)
    packed = PackedWindows(tokens, mask, doc)  # 20 windows of two samples
    loader = TokenLoader(packed, 3, 15, seed=5, prefetch=0)
    seen = [loader.next() for _ in range(7)]  # 21 windows: one epoch and one more
    first = torch.cat([b[0] for b in seen])[:20]
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, tokens[:, :-1].tolist()))
    state = loader.state_dict()
    later = [loader.next() for _ in range(3)]
    resumed = TokenLoader(packed, 3, 15, seed=5, prefetch=0)
    resumed.load_state_dict(state)
    for a, b in zip(later, [resumed.next() for _ in range(3)]):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    threaded = TokenLoader(packed, 3, 15, seed=5, prefetch=2, threaded=True)
    assert all(torch.equal(p, q) for p, q in zip(seen[0], threaded.next()))
    threaded.close()
    (vx, vy, vd), = list(val_batches(packed, 32, 15, 1))
    assert torch.equal(vx, torch.from_numpy(tokens[:, :-1]).long()) and vd.shape == vx.shape


def test_refusals_name_the_key_and_the_fix(tmp_path, tokenizer_dirs):
    def refused(match, **data):
        with pytest.raises(KilnError, match=match):
            DataConfig(**data).validate()

    refused(r"data.records='dialog' is unknown", records="dialog")
    refused(r"data.train_on='prompt' is unknown", train_on="prompt")
    refused(r"data.records=chat with data.format=tokens", records="chat", format="tokens")
    refused(r"data.records=chat with data.tokenizer=bpe", records="chat", tokenizer="bpe")
    DataConfig(records="chat").validate()  # bytes and the tokenizer's template: model.init=hf:DIR may give both
    from kiln.config import load_config
    with pytest.raises(KilnError, match=r"data.tokenizer='bytes' has no chat template; set data.chat_template=chatml"):
        load_config(None, ["--data.records=chat"])  # without model.init: refused with the config
    refused(rf"has no chat template \({tokenizer_dirs['none']} has no chat_template.jinja",
            records="chat", tokenizer=f"hf:{tokenizer_dirs['none']}")
    refused(r"data.chat_template='x.txt' is neither chatml nor an existing .jinja", records="chat",
            chat_template="x.txt")
    (tmp_path / "bad.jinja").write_text("{% for %}")
    refused(r"bad.jinja: the chat template does not parse", records="chat", chat_template=str(tmp_path / "bad.jinja"))
    DataConfig(records="chat", chat_template="chatml").validate()  # bytes + chatml: markers as text


def test_bytes_tokenizer_offsets_cover_every_byte():
    ids, offsets = ByteTokenizer().chat_offsets("a\u00e9\U0001f600")
    assert ids == list("a\u00e9\U0001f600".encode()) and offsets == [(0, 1), (1, 2), (1, 2)] + [(2, 3)] * 4
    template = Template("{% for m in messages %}[{{ m.role }}]{% generation %}{{ m.content }}.{% endgeneration %}"
                        "{% endfor %}", generation=True)
    ids, mask = encode_sample([{"role": "assistant", "content": "\u00e9"}], template, ByteTokenizer(), "assistant", "t")
    assert bytes(np.asarray(ids)[mask].tolist()).decode() == "\u00e9."


def test_finetune_from_hf_logs_counted_tokens_and_packed_equals_alone(tmp_path, tokenizer_dirs, small_config):
    """kiln train on chat records from model.init=hf:DIR (a GPT-2 with the Llama-3-style tokenizer: its template
    comes with it): each step's loss_tokens is the loader's counted targets (a hand count of its batches), and
    through the model a packed window's per-token losses are each sample's run alone (fp32)."""
    import shutil

    from kiln.run.data_show import show
    from kiln.run.lm import train

    hf = tmp_path / "hf"
    shutil.copytree(tokenizer_dirs["llama3"], hf)
    vocab = BPETokenizer.from_hf(hf).vocab_size
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2,
                                                         n_head=2)).save_pretrained(hf)
    source = _write(tmp_path / "chat.jsonl", _records(40))

    def cfg(steps, **sections):
        c = small_config(data={"source": str(source), "records": "chat", "seq_len": 64, "val_fraction": 0.2},
                         train={"max_steps": steps, "eval_interval": 2, "grad_accum_steps": 2},
                         schedule={"total_steps": 2}, **sections)
        c.model.init = f"hf:{hf}"
        return c

    # (a resumed run's losses equal the straight run's: checked once, 2 steps against 1 + resume; left out for the
    # suite's time, 3 runs of ~10 s each on a loaded 2-core CPU; the loader's own resume is checked above)
    result = train(cfg(2), tmp_path / "straight")
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train_records = {"straight": [r for r in records if r["kind"] == "train"]}
    data_cfg = result.cfg.data  # the run's: model.init's tokenizer
    assert data_cfg.tokenizer == f"hf:{hf}"
    data = prepare_data(data_cfg, log=lambda m: None)
    loader = TokenLoader(data.train, 4, 64, data_cfg.seed, prefetch=0)
    want = [sum(int((loader.next()[1] != IGNORE_INDEX).sum()) for _ in range(2)) for _ in range(2)]
    assert [r["loss_tokens"] for r in train_records["straight"]] == want and all(0 < n < 2 * 4 * 64 for n in want)
    assert result.val_loss is not None and np.isfinite(result.val_loss)
    lines = show(result.cfg, rows=1, positions=16, log=lambda m: None)
    x, y, doc = TokenLoader(data.train, 4, 64, data_cfg.seed, prefetch=0).next()
    assert f" row 0: the loss counts {int((y[0] != IGNORE_INDEX).sum())} of 64 targets" in "\n".join(lines)

    model = result.state.model.eval()
    with torch.no_grad():
        packed = torch.nn.functional.cross_entropy(model(x[:1], doc=doc[:1])[0], y[0].clamp(min=0), reduction="none")
        for k in doc[0].unique().tolist():  # padding, the last document, counts nothing
            at = (doc[0] == k).nonzero().flatten()
            want = torch.nn.functional.cross_entropy(model(x[:1, at])[0], y[0, at].clamp(min=0), reduction="none")
            counted = y[0, at] != IGNORE_INDEX
            torch.testing.assert_close(packed[at][counted], want[counted], rtol=1e-5, atol=1e-6)


def test_a_mixture_of_chat_sources_draws_whole_windows_by_weight(tmp_path, tokenizer_dirs):
    a = _write(tmp_path / "a.jsonl", _records(30))
    b = _write(tmp_path / "b.jsonl", [{"prompt": f"say {i}", "completion": "x" * 3} for i in range(30)])
    cfg = DataConfig(tokenizer=f"hf:{tokenizer_dirs['qwen3']}", records="chat", seq_len=48, val_fraction=0.2,
                     cache_dir=str(tmp_path / "cache"), mix=({"source": str(a), "weight": 3}, {"source": str(b)}))
    data = prepare_data(cfg, log=lambda m: None)
    parts = {name: part.train for name, _, part in data.sources}
    x, y, doc = TokenLoader(data.train, 400, 48, 0, prefetch=0).next()
    windows = {name: {tuple(r) for r in p.tokens[:, :-1].tolist()} for name, p in parts.items()}
    rows = [tuple(r) for r in x.tolist()]
    assert all(r in windows["a"] or r in windows["b"] for r in rows)  # whole windows of one source
    share = sum(r in windows["a"] for r in rows) / len(rows)
    assert 0.68 < share < 0.82  # weight 3 of 4, 400 draws: 0.75 ± 3.5 standard deviations
