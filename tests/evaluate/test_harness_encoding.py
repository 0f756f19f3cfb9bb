"""kiln tokenizes a task as lm-evaluation-harness 0.4's HFLM does with its defaults (kiln.evaluate.encoding), on an
hf: tokenizer whose post-processor adds a BOS token (as a Llama's does): the reference is transformers' own
tokenizer of the directory with the harness's rules written out (HFLM.tok_encode, TemplateLM._encode_pair, the
empty-context branch of TemplateLM.loglikelihood, HFLM.prefix_token_id)."""
import json
import shutil

import pytest

from kiln.errors import KilnError
from kiln.evaluate import load_tasks, prepare, training_tasks
from kiln.parallel.layout import ParallelPlan
from kiln.run.source import load_source
from kiln.train.settings import TrainConfig

BOS = "<s>"
ROWS = [("def f(x):\n    return", "x"), ("Question: which keyword? ", "def"),  # trailing space: to the continuation
        ("", "import os"),  # an empty context: the prefix token, the continuation without the BOS
        ("a = 1<|endoftext|>b =", "2"),  # a special token written in the text: its id
        (BOS + "def g():", "pass")]  # a text that starts with the BOS text: no BOS added
DOC = "import os\nimport sys\n" * 3


@pytest.fixture(scope="module")
def bos_export(exported, tmp_path_factory):
    """The export with a BOS token added to its tokenizer (id 300) and a post-processor that puts it before every
    text, named bos_token in tokenizer_config.json."""
    from tokenizers import Tokenizer, processors

    directory = tmp_path_factory.mktemp("bos") / "hf"
    shutil.copytree(exported, directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([BOS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": BOS}))
    return directory


def harness_pairs(tokenizer, rows):
    """What HFLM (add_bos_token and prefix_token_id unset) hands to _loglikelihood_tokens for each row."""
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

    def tok_encode(text, add_special_tokens=None):
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and text.startswith(tokenizer.decode(prefix)):
            kwargs["add_special_tokens"] = False
        return tokenizer.encode(text, **kwargs)

    out = []
    for context, continuation in rows:
        if not context:
            cont = tok_encode(continuation, add_special_tokens=False)
            out.append(([prefix], cont) if prefix != cont[0] else (cont[:1], cont[1:]))
            continue
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation, context = context[-spaces:] + continuation, context[:-spaces]
        whole, head = tok_encode(context + continuation), tok_encode(context)
        out.append((head, whole[len(head):]))
    return out, prefix, tok_encode


def test_a_bos_adding_tokenizer_is_encoded_as_the_harness_encodes_it(bos_export, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    reference = transformers.AutoTokenizer.from_pretrained(bos_export)
    want, prefix, tok_encode = harness_pairs(reference, [(c, " " + x) for c, x in ROWS])
    source = load_source(f"hf:{bos_export}", device="cpu")
    assert source.prefix_id == prefix == reference.convert_tokens_to_ids(BOS) != source.eot_id
    task = tmp_path / "mc.jsonl"
    task.write_text("".join(json.dumps({"context": c, "choices": [x], "label": 0}) + "\n" for c, x in ROWS))
    (tmp_path / "doc.txt").write_text(DOC)
    mc, doc = (prepare(t, source.tokenizer, 32, prefix_id=source.prefix_id)
               for t in load_tasks([str(task), f"text:{tmp_path / 'doc.txt'}"]))
    got = [(list(p.context), list(p.continuation)) for p in mc.pairs]
    assert got == want
    # the BOS really is there: every context but the empty one (the prefix, which is the BOS) and the one that
    # starts with the BOS text (encoded without the post-processor, its own BOS text the BOS id) starts with it
    assert [c[0] == prefix for c, _ in got] == [True] * 5 and [c.count(prefix) for c, _ in got] == [1, 1, 1, 1, 1]
    assert reference.eos_token_id in got[3][0]  # the end-of-text written in the text is its id
    tokens = tok_encode(DOC)  # loglikelihood_rolling: the text with the post-processor's BOS, after the prefix
    assert tokens[0] == prefix and [list(doc.pairs[0].context), list(doc.pairs[0].continuation)] == \
        [[prefix], tokens[:32]]
    assert [t for p in doc.pairs for t in p.continuation] == tokens  # every token predicted once


@pytest.mark.parametrize("plan, multiple", [(ParallelPlan(2, strategy="fsdp", cp=2), 4),
                                            (ParallelPlan(2, tp=2, sequence_parallel=True), 2)])
def test_a_window_the_padded_batches_cannot_fill_is_one_line(exported, tmp_path, plan, multiple):
    """train.eval_tasks pads each batch to a multiple of 2·cp (and of tp under sequence parallelism): a
    model.max_seq_len that is not one is refused before the run trains."""
    task = tmp_path / "mc.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": ["b"], "label": 0}) + "\n")
    tc = TrainConfig(eval_tasks=(str(task),))
    tokenizer = load_source(f"hf:{exported}", device="cpu").tokenizer
    assert len(training_tasks(tc, tokenizer, 32, plan, log=lambda m: None)) == 1
    with pytest.raises(KilnError, match=f"pads each batch to a multiple of {multiple} tokens") as e:
        training_tasks(tc, tokenizer, 31, plan, log=lambda m: None)
    assert e.value.key == "model.max_seq_len" and "\n" not in str(e.value)
