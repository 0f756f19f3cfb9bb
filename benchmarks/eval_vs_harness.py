"""`kiln eval` against lm-evaluation-harness on the same model and the same items: acc, acc_norm, their standard
errors, word/byte perplexity and bits per byte, and the largest difference of any choice's log-likelihood.

    .venv/bin/python benchmarks/eval_vs_harness.py --harness-python LMEVAL_VENV/bin/python [--run RUN_DIR]

The harness runs in its own virtual environment (`pip install torch==<kiln's> lm_eval transformers accelerate`),
given by --harness-python. Without --run, a small GPT-2 with a BPE tokenizer is trained first on 24
standard-library modules (a bytes-tokenizer run exports no tokenizer file the harness could load). The model is
exported with `kiln export`; the tasks are made from 12 other modules: a multiple-choice JSONL (which of four lines
follows three lines of code; the right one at a random place), the same items as HellaSwag rows (read on the
harness's side by its own hellaswag preprocessing, copied from its installed package at run time) and a text JSONL
for perplexity, each read by the harness through a local YAML task (dataset_path: json; nothing is downloaded).
Both sides score in fp32 on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from kiln.evaluate import load_task, loglikelihoods, prepare
from kiln.run.source import load_source

ROOT = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN = ["textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "copy.py", "csv.py", "glob.py",
         "base64.py", "calendar.py", "difflib.py", "gettext.py", "ipaddress.py", "locale.py", "netrc.py",
         "numbers.py", "operator.py", "optparse.py", "pprint.py", "queue.py", "random.py", "sched.py", "string.py",
         "tempfile.py"]
HELD_OUT = ["argparse.py", "configparser.py", "contextlib.py", "dataclasses.py", "enum.py", "functools.py",
            "inspect.py", "pathlib.py", "shutil.py", "statistics.py", "tarfile.py", "zipfile.py"]

MC_YAML = """task: kiln_mc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
validation_split: validation
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
HELLASWAG_YAML = """task: kiln_hellaswag
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
validation_split: validation
output_type: multiple_choice
process_docs: !function utils.process_docs
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
PPL_YAML = """task: kiln_text
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {path}
validation_split: validation
output_type: loglikelihood_rolling
doc_to_text: text
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
HARNESS = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
out = lm_eval.simple_evaluate(model="hf", model_args="pretrained={model},dtype=float32",
                              tasks=["kiln_mc", "kiln_hellaswag", "kiln_text"],
                              task_manager=TaskManager(include_path="{tasks}"), device="cpu", batch_size=8,
                              log_samples=True, limit={limit})
lls = {{t: [[float(r[0][0]) for r in s["resps"]] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])]
       for t in ("kiln_mc", "kiln_hellaswag")}}
json.dump({{"results": out["results"], "lls": lls, "version": lm_eval.__version__ if hasattr(lm_eval, "__version__")
           else "?"}}, open("{dest}", "w"))
"""


def hellaswag_rows(items: list[dict], rng: random.Random) -> list[dict]:
    """The multiple-choice items as HellaSwag rows, with the WikiHow markers ([title], [step], double spaces) its
    preprocessing removes sprinkled in, and string labels as the dataset has them."""
    rows = []
    for item in items:
        first, second, third = item["context"].split("\n")
        marks = ["", " [title]", " [step]", "  "]
        endings = [c + rng.choice(marks) + (" more" if rng.random() < 0.3 else "") for c in item["choices"]]
        rows.append({"activity_label": "Python [header]", "ctx_a": first.strip() + rng.choice(marks) + " " +
                     second.strip(), "ctx_b": third.strip(), "endings": endings, "label": str(item["label"])})
    return rows


def make_tasks(directory: Path, n_items: int, n_docs: int, seed: int = 0) -> tuple[Path, Path, Path]:
    rng = random.Random(seed)
    lines = [line for name in HELD_OUT for line in (STDLIB / name).read_text().splitlines()]
    code = [i for i in range(3, len(lines)) if len(lines[i].strip()) > 20 and all(lines[i - k].strip()
                                                                                for k in (1, 2, 3))]
    items = []
    for i in rng.sample(code, n_items):
        others = rng.sample([lines[j].strip() for j in rng.sample(code, 10) if lines[j].strip() != lines[i].strip()], 3)
        label = rng.randrange(4)
        choices = others[:label] + [lines[i].strip()] + others[label:]
        items.append({"context": "\n".join(lines[i - 3:i]), "choices": choices, "label": label})
    mc = directory / "kiln_mc.jsonl"
    mc.write_text("".join(json.dumps(r) + "\n" for r in items))
    hella = directory / "kiln_hellaswag.jsonl"
    hella.write_text("".join(json.dumps(r) + "\n" for r in hellaswag_rows(items, rng)))
    text = "\n".join((STDLIB / name).read_text() for name in HELD_OUT)
    starts = sorted(rng.sample(range(0, len(text) - 3000), n_docs))
    docs = directory / "kiln_text.jsonl"
    docs.write_text("".join(json.dumps({"text": text[s:s + rng.randrange(300, 3000)]}) + "\n" for s in starts))
    (directory / "kiln_mc.yaml").write_text(MC_YAML.format(path=mc))
    (directory / "kiln_text.yaml").write_text(PPL_YAML.format(path=docs))
    (directory / "kiln_hellaswag.yaml").write_text(HELLASWAG_YAML.format(path=hella))
    return mc, hella, docs


def kiln(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kiln", *args], cwd=ROOT, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--harness-python", required=True, help="python of a venv with lm_eval installed")
    ap.add_argument("--run", help="a run with a BPE tokenizer (default: train one)")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eval-vs-harness-"))
    run = Path(args.run) if args.run else work / "run"
    if not args.run:
        corpus = work / "corpus.txt"
        corpus.write_text("\n\n".join((STDLIB / n).read_text() for n in TRAIN))
        kiln("train", f"--data.source={corpus}", "--data.tokenizer=bpe", "--data.vocab_size=2048",
             "--model.preset=tiny", "--model.n_layer=2", "--model.d_model=128", "--model.n_head=4",
             "--model.max_seq_len=128", "--data.seq_len=128", f"--train.max_steps={args.steps}",
             "--train.micro_batch_size=16", "--train.device=cpu", "--precision.mode=fp32", "--train.sample_tokens=0",
             "--log.progress=off", "--log.tensorboard=false", f"--run-dir={run}")
    kiln("export", str(run), "--hf", str(work / "hf"))
    tasks = work / "tasks"
    tasks.mkdir()
    mc, hella, docs = make_tasks(tasks, args.items, args.docs)
    # the harness's own hellaswag preprocessing (its tasks/hellaswag/utils.py, from its installed package) beside
    # the YAML that names it
    harness_dir = subprocess.run([args.harness_python, "-c", "import lm_eval, os; print(os.path.dirname("
                                  "lm_eval.__file__))"], capture_output=True, text=True, check=True).stdout.strip()
    shutil.copy(Path(harness_dir) / "tasks" / "hellaswag" / "utils.py", tasks / "utils.py")
    kiln("eval", str(run), "--task", str(mc), "--task", str(hella), "--task", f"text:{docs}", "--device", "cpu",
         "--batch-size", "8", "--out", str(work / "kiln.json"))
    script = HARNESS.format(model=work / "hf", tasks=tasks, limit=None, dest=work / "harness.json")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run([args.harness_python, "-c", script], check=True, env=env, cwd=work)
    ours = json.loads((work / "kiln.json").read_text())["results"]
    theirs = json.loads((work / "harness.json").read_text())
    # every choice's log-likelihood from kiln's API, against the harness's logged responses
    source = load_source(str(run), device="cpu")
    print(f"lm_eval {theirs['version']}, torch {torch.__version__}; {args.items} items per multiple-choice task, "
          f"{args.docs} documents; work dir {work}")
    for name, path in (("kiln_mc", mc), ("kiln_hellaswag", hella)):
        prepared = prepare(load_task(str(path)), source.tokenizer, source.max_seq_len)
        lls, _ = loglikelihoods(source.model, prepared.pairs, source.model_cfg.vocab_size, source.max_seq_len, 8)
        flat = torch.tensor([x for item in theirs["lls"][name] for x in item], dtype=torch.float64)
        print(f"{name}: largest |log-likelihood difference| over its {len(flat)} choices: "
              f"{(lls - flat).abs().max().item():.3g} nats")
    print(f"{'task':<15} {'metric':<28} {'kiln':>14} {'harness':>14}")
    for task, name in (("kiln_mc", mc.stem), ("kiln_hellaswag", hella.stem), ("kiln_text", docs.stem)):
        for key, value in ours[name].items():
            if key == "alias":
                continue
            other = theirs["results"][task].get(key, "-")
            show = (lambda v: f"{v:.6f}" if isinstance(v, float) else str(v))
            print(f"{task:<15} {key:<28} {show(value):>14} {show(other):>14}")


if __name__ == "__main__":
    main()
