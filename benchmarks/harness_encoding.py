"""kiln's tokenization of task rows against lm-evaluation-harness's own code on one Hugging Face directory: the
(context, continuation) ids HFLM.loglikelihood hands to _loglikelihood_tokens, and the rolling windows of
loglikelihood_rolling, with the harness's defaults (add_bos_token and prefix_token_id unset).

    .venv/bin/python benchmarks/harness_encoding.py --harness-python LMEVAL_VENV/bin/python --hf DIR [--add-bos]

DIR is any directory `kiln eval hf:DIR` loads (tests/evaluate's export, or `kiln export`'s). --add-bos scores a copy
whose tokenizer gets a "<s>" token, a post-processor that puts it before every text (as a Llama tokenizer's does)
and bos_token "<s>" in tokenizer_config.json. The harness side builds an HFLM without a model (only its
tokenization runs) in the harness's own virtual environment. Prints both sides' prefix token and whether every
pair and window is identical (else the first that differs); exit status 1 when they differ.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kiln.evaluate import load_tasks, prepare
from kiln.run.source import load_source

ROWS = [["def f(x):\n    return", "x"], ["Question: which keyword? ", "def"], ["", "import os"],
        ["a = 1<|endoftext|>b =", "2"], ["<s>def g():", "pass"], ["é ünïcode <s> mid", "ok"]]
DOC = "import os\nimport sys\n" * 3
WINDOW = 32

HARNESS = """
import json, sys
import transformers
from lm_eval import utils
from lm_eval.models.huggingface import HFLM
directory, rows, doc, window = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
lm = HFLM.__new__(HFLM)  # no model: only the tokenization runs
lm.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
lm.backend, lm.add_bos_token, lm.custom_prefix_token_id, lm.enable_thinking = "causal", None, None, None
seen = []
lm._loglikelihood_tokens = lambda requests, disable_tqdm=False: seen.extend(requests) or []
class Request:
    def __init__(self, args):
        self.args = args
lm.loglikelihood([Request((c, " " + x)) for c, x in rows], disable_tqdm=True)
windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
    token_list=lm.tok_encode(doc), prefix_token=lm.prefix_token_id, max_seq_len=window, context_len=1))
print(json.dumps({"prefix": lm.prefix_token_id, "pairs": [[list(c), list(x)] for _, c, x in seen],
                  "windows": [[list(c), list(x)] for c, x in windows]}))
"""


def with_bos(directory: Path, into: Path) -> Path:
    from tokenizers import Tokenizer, processors

    shutil.copytree(directory, into)
    tok = Tokenizer.from_file(str(into / "tokenizer.json"))
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(into / "tokenizer.json"))
    config = into / "tokenizer_config.json"
    named = json.loads(config.read_text()) if config.is_file() else {"tokenizer_class": "PreTrainedTokenizerFast"}
    config.write_text(json.dumps(named | {"bos_token": "<s>"}))
    return into


def kiln_side(directory: Path, work: Path) -> dict:
    source = load_source(f"hf:{directory}", device="cpu")
    (work / "mc.jsonl").write_text("".join(json.dumps({"context": c, "choices": [x], "label": 0}) + "\n"
                                           for c, x in ROWS))
    (work / "doc.txt").write_text(DOC)
    mc, doc = (prepare(t, source.tokenizer, WINDOW, prefix_id=source.prefix_id)
               for t in load_tasks([str(work / "mc.jsonl"), f"text:{work / 'doc.txt'}"]))
    return {"prefix": source.prefix_id if source.prefix_id is not None else source.eot_id,
            "pairs": [[list(p.context), list(p.continuation)] for p in mc.pairs],
            "windows": [[list(p.context), list(p.continuation)] for p in doc.pairs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--harness-python", required=True, help="python of a venv with lm_eval installed")
    ap.add_argument("--hf", required=True, type=Path, help="a Hugging Face directory kiln eval loads")
    ap.add_argument("--add-bos", action="store_true", help="score a copy with a BOS-adding post-processor")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        directory = with_bos(args.hf, work / "hf") if args.add_bos else args.hf
        ours = kiln_side(directory, work)
        out = subprocess.run([args.harness_python, "-c", HARNESS, str(directory), json.dumps(ROWS), DOC, str(WINDOW)],
                             check=True, capture_output=True, text=True).stdout
        theirs = json.loads(out.strip().splitlines()[-1])
    print(f"prefix token: kiln {ours['prefix']}, harness {theirs['prefix']}")
    for key in ("pairs", "windows"):
        differ = [i for i, (a, b) in enumerate(zip(ours[key], theirs[key])) if a != b]
        if len(ours[key]) != len(theirs[key]) or differ:
            at = differ[0] if differ else min(len(ours[key]), len(theirs[key]))
            print(f"{key}: differ at {at}: kiln {ours[key][at:at + 1]}, harness {theirs[key][at:at + 1]}")
            return 1
        print(f"{key}: {len(ours[key])} identical")
    return 0 if ours["prefix"] == theirs["prefix"] else 1


if __name__ == "__main__":
    sys.exit(main())
