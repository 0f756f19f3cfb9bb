"""train.eval_tasks on the split layouts (tp × dp with sequence parallelism, dp × cp, pp × dp), in the existing
launches: the worker sets the tasks on one of its runs and scores them again after it through the run's layout;
the test scores the same tasks on the run's final checkpoint in one process (kiln.evaluate.forward)."""
import json
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from kiln.data.tokenizer import load_tokenizer
from kiln.evaluate import load_tasks, loglikelihoods, prepare, score_task
from kiln.run.source import load_source

WINDOW = 64  # the runs' model.max_seq_len
PADDED_FROM = 200  # scored again as if ids 200.. were the padding rows: the tp rank holding them must leave them out
RTOL = 1e-5


def with_tasks(cfg, out: Path):
    """cfg scoring train.eval_tasks at its evaluation: 7 multiple-choice items of 2-4 choices (uneven shares over
    the data-parallel copies) and a 5-window text, written by every rank (the same bytes; the rename makes each
    whole)."""
    tasks = out / "eval_tasks"
    tasks.mkdir(exist_ok=True)
    items = [{"context": f"def f{i}(x):\n    return", "choices": [" x", " x * 2", " None", " f(x)"][:2 + i % 3],
              "label": i % 2} for i in range(7)]
    files = {"mc.jsonl": "".join(json.dumps(r) + "\n" for r in items), "doc.txt": "import os\nimport sys\n" * 15}
    for name, text in files.items():
        (tasks / f"{name}.{os.environ['RANK']}").write_text(text)
        os.replace(tasks / f"{name}.{os.environ['RANK']}", tasks / name)
    cfg.train.eval_tasks = task_files(out)
    return cfg


def task_files(out: Path) -> tuple[str, str]:
    return str(out / "eval_tasks" / "mc.jsonl"), f"text:{out / 'eval_tasks' / 'doc.txt'}"


def pairs_of(out: Path, tokenizer) -> list:
    return [p for t in load_tasks(list(task_files(out))) for p in prepare(t, tokenizer, WINDOW).pairs]


def score_after(state, out: Path, run_dir: Path) -> None:
    """Every rank, after the run: each pair's log-likelihood through the run's layout (batches of 8: 2 micro-batches
    of 4 under pp2), with the model's vocabulary and as if ids PADDED_FROM.. were padding; rank 0 writes
    RUN_DIR/task_lls.json and prints how long the two took (the launch's log)."""
    began = time.monotonic()
    pairs = pairs_of(out, load_tokenizer(run_dir))
    vocab = getattr(state.model, "module", state.model).cfg.vocab_size  # (DDP's wrapper)
    lls = {str(v): loglikelihoods(state.model, pairs, v, WINDOW, batch_size=8, world=state.world)[0].tolist()
           for v in (vocab, PADDED_FROM)}
    if dist.get_rank() == 0:
        (run_dir / "task_lls.json").write_text(json.dumps(lls))
        print(f"{run_dir.name}: tasks scored twice after the run in {time.monotonic() - began:.2f} s", flush=True)


def assert_tasks_score_as_one_process(out: Path, run_dir: Path, eval_record: dict) -> None:
    """The run's last eval record and its scores after the run equal the tasks scored in this one process on its
    final checkpoint: acc and acc_norm exactly, the log-likelihoods and bits per byte to RTOL. (Call it on one
    thread, tests.parallel.conftest.one_thread: 0.2 s, where 2 threads took 3-8 s on the loaded 2-core Xeon.)"""
    source = load_source(run_dir, device="cpu")
    vocab = source.model_cfg.vocab_size
    pairs = pairs_of(out, source.tokenizer)
    got = json.loads((run_dir / "task_lls.json").read_text())
    assert sorted(got) == sorted({str(vocab), str(PADDED_FROM)}) and vocab > PADDED_FROM
    for v in (vocab, PADDED_FROM):
        want = loglikelihoods(source.model, pairs, v, WINDOW, batch_size=4)[0].tolist()
        assert got[str(v)] == pytest.approx(want, rel=RTOL), v
    mc, doc = (score_task(source.model, prepare(t, source.tokenizer, WINDOW), vocab=vocab, max_length=WINDOW)
               for t in load_tasks(list(task_files(out))))
    assert eval_record["task_mc_acc"] == mc.results["acc,none"]
    assert eval_record["task_mc_acc_norm"] == mc.results["acc_norm,none"]
    assert eval_record["task_mc_acc_stderr"] == pytest.approx(mc.results["acc_stderr,none"], rel=1e-12)
    assert eval_record["task_doc_bpb"] == pytest.approx(doc.results["bits_per_byte,none"], rel=RTOL)
