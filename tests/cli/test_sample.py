"""`kiln sample` end to end on an hf: directory written here (a random 2-layer Llama, a 300-token BPE tokenizer and
a chat template): stop strings, the eos ids of generation_config.json, a left-padded prompt file against each
prompt alone, messages through the template, the cache against --no-kv-cache, the window line; and the sample
at the end of `kiln train` against `kiln sample` on the run."""
import json
import re

import pytest
import torch

from kiln.cli.main import main
from kiln.data.tokenizer import BPETokenizer
from kiln.interop.hf import write_hf
from kiln.models import ModelConfig, build_model
from kiln.models.generate import generate
from kiln.run.source import load_source

TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant:{% endif %}")
RATE = re.compile(r"^\d+ tokens in \d+\.\d\d s \([\d,]+\.\d tokens/s\)$")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-layer model's step is a few small matmuls (see tests/models/test_generate.py)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, corpus_file):
    directory = tmp_path_factory.mktemp("hf sample")
    tok = BPETokenizer.train([corpus_file.read_text()], 300)
    tok.save(directory)
    torch.manual_seed(0)
    cfg = ModelConfig(preset="nano", arch="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96,
                      max_seq_len=64, vocab_size=300).resolve()
    write_hf(cfg, build_model(cfg).state_dict(), 300, directory, eos=tok.eot_id)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return directory


def _sample(capsys, *argv):
    assert main(["sample", *argv, "--device=cpu"]) == 0
    out, err = capsys.readouterr()
    return out.removesuffix("\n"), err.strip().splitlines()


def test_stop_strings_and_eos_ids_end_the_text(hf_dir, capsys):
    src = f"hf:{hf_dir}"
    full, err = _sample(capsys, src, "--prompt=def f(x):", "--temperature=0", "--max-new-tokens=30")
    assert full.startswith("def f(x):") and RATE.match(err[0]) and err[0].startswith("30 tokens")
    completion = full.removeprefix("def f(x):")
    stop = completion[8:11]
    cut, err = _sample(capsys, src, "--prompt=def f(x):", "--temperature=0", "--max-new-tokens=30", "--stop=zzzq",
                       f"--stop={stop}")
    assert cut == "def f(x):" + completion[:completion.index(stop)] and int(err[0].split()[0]) < 30
    # every eos_token_id of generation_config.json ends a completion (the id itself is not printed)
    source = load_source(src, "cpu")
    tokens = generate(source.model, [source.tokenizer.encode("def f(x):")], 30, vocab_limit=300).tokens[0]
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [source.eot_id, tokens[6]]}))
    try:
        ended, _ = _sample(capsys, src, "--prompt=def f(x):", "--temperature=0", "--max-new-tokens=30")
    finally:
        (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": source.eot_id}))
    assert ended == "def f(x):" + source.tokenizer.decode(tokens[:tokens.index(tokens[6])])


def test_a_prompt_file_in_batches_gives_each_prompt_alone_and_renders_messages(hf_dir, tmp_path, capsys):
    src = f"hf:{hf_dir}"
    rows = [{"prompt": "import os"}, {"prompt": "x", "id": 7}, {"prompt": "class Stack:\n    def push(self, item):"},
            {"messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]}, {"prompt": ""}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    greedy = ["--temperature=0", "--max-new-tokens=12"]
    batched, err = _sample(capsys, src, f"--prompt-file={path}", "--batch-size=4", *greedy)
    alone, _ = _sample(capsys, src, f"--prompt-file={path}", "--batch-size=1", *greedy)
    plain, _ = _sample(capsys, src, f"--prompt-file={path}", "--no-kv-cache", *greedy)
    out = [json.loads(line) for line in batched.splitlines()]
    assert batched == alone == plain and len(out) == 5 and RATE.match(err[0])
    assert [{k: v for k, v in o.items() if k != "completion"} for o in out] == rows
    assert all(len(o["completion"]) > 0 for o in out)
    # a messages row is the conversation rendered by the template, as --chat renders a prompt
    chat, _ = _sample(capsys, src, "--chat", "--prompt=hi", *greedy)
    (tmp_path / "t.jinja").write_text(TEMPLATE.replace("{{ m.role }}: ", ""))
    other, _ = _sample(capsys, src, "--chat", "--prompt=hi", f"--chat-template={tmp_path / 't.jinja'}", *greedy)
    source = load_source(src, "cpu")
    ids = source.tokenizer.encode_chat("<|endoftext|>user: hi\n<|endoftext|>assistant:")
    assert chat == source.tokenizer.decode(generate(source.model, [ids], 12, vocab_limit=300).tokens[0])
    assert other != chat
    row = [{"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text(json.dumps(row[0]) + "\n")
    assert json.loads(_sample(capsys, src, f"--prompt-file={path}", *greedy)[0])["completion"] == chat


def test_the_cache_stops_at_max_seq_len_with_one_line(hf_dir, capsys):
    T = len(BPETokenizer.from_hf(hf_dir).encode("def f(x):"))
    text, err = _sample(capsys, f"hf:{hf_dir}", "--prompt=def f(x):", "--max-new-tokens=100", "--temperature=0")
    # 64 positions: the prompt and 64 - T fed back; the last token is predicted from the full window
    assert err[0].startswith(f"{64 - T + 1} tokens") and len(err) == 2 and "model.max_seq_len=64" in err[1]
    text, err = _sample(capsys, f"hf:{hf_dir}", "--prompt=def f(x):", "--max-new-tokens=100", "--temperature=0",
                        "--no-kv-cache")
    assert err[0].startswith("100 tokens") and len(err) == 1


def test_the_sample_after_training_is_kiln_samples(small_config, tmp_path):
    from kiln.run.lm import train
    from kiln.run.sample import sample_from_run

    # recompute swaps the blocks' class (its forward takes no cache): the sample runs on a plain copy
    result = train(small_config(train={"max_steps": 2, "sample_tokens": 24}, memory={"recompute": "full"}),
                   tmp_path / "run")
    assert result.state.applied["recompute"] and result.sample.startswith("def ")
    assert result.sample == sample_from_run(tmp_path / "run", "def ", 24, 0.8, 50, seed=0, device="cpu")
