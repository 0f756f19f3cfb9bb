"""`kiln eval` end to end, and train.eval_tasks in a run: the scores agree with transformers' and with each other;
bad input is one line."""
import json
import re

import pytest

from kiln.cli.main import main
from tests.evaluate.test_loglik import LONG, reference


ITEMS = [{"context": "def f(x):\n    return", "choices": ["x", "banana split", "é"], "label": 0},
         {"context": "import", "choices": [" os", "sys", "日本語"], "label": 1},
         {"context": "for i in", "choices": ["range(10):", "x", "y"], "label": 2},
         {"context": LONG, "choices": ["pop", "push"], "label": 1}]


@pytest.fixture
def tasks(tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps(r) + "\n" for r in ITEMS))
    doc = tmp_path / "doc.txt"
    doc.write_text(LONG * 2)
    return mc, doc


def test_kiln_eval_scores_as_transformers_and_writes_the_harness_layout(exported, hf, tasks, tmp_path, capsys):
    mc, doc = tasks
    out = tmp_path / "r" / "results.json"
    assert main(["eval", f"hf:{exported}", "--task", str(mc), "--task", f"text:{doc}", "--device", "cpu",
                 "--batch-size", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    model, tokenizer = hf
    acc, norm = [], []
    for item in ITEMS:
        lls = [reference(model, tokenizer, item["context"], " " + c, 32)[0] for c in item["choices"]]
        acc.append(float(max(range(len(lls)), key=lambda i: (lls[i], -i)) == item["label"]))
        normed = [ll / len(c) for ll, c in zip(lls, item["choices"])]
        norm.append(float(max(range(len(lls)), key=lambda i: (normed[i], -i)) == item["label"]))
    r = saved["results"]["mc"]
    assert (r["acc,none"], r["acc_norm,none"]) == (sum(acc) / 4, sum(norm) / 4)
    p = sum(acc) / 4
    assert r["acc_stderr,none"] == pytest.approx((p * (1 - p) / 3) ** 0.5)  # 0/1 values: sqrt(p(1-p)/(n-1))
    assert set(saved["results"]["doc"]) == {"alias", "word_perplexity,none", "word_perplexity_stderr,none",
                                            "byte_perplexity,none", "byte_perplexity_stderr,none",
                                            "bits_per_byte,none", "bits_per_byte_stderr,none"}
    assert saved["n-samples"] == {"mc": {"original": 4, "effective": 4}, "doc": {"original": 1, "effective": 1}}
    assert saved["checkpoint_step"] is None and saved["model"].startswith(f"hf:{exported} (gpt2, ")
    assert saved["items"] == {"mc": 4, "doc": 1} and saved["truncated"] == {"mc": 2, "doc": 0}
    assert "mc: 2 context(s) longer than the window of 32 tokens lost their start" in printed
    assert re.search(rf"^mc +4 +acc +{r['acc,none']:.4f} +{r['acc_stderr,none']:.4f}$", printed, re.M), printed
    assert re.search(r"^doc +1 +bits_per_byte +\d+\.\d{4} +N/A$", printed, re.M), printed
    assert main(["eval", f"hf:{exported}", "--task", str(mc), "--limit", "1", "--device", "cpu",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["n-samples"]["mc"] == {"original": 4, "effective": 1}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_input_is_one_line(exported, tasks, tmp_path, capsys):
    mc, _ = tasks
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ITEMS[0]) + "\n" + json.dumps({"context": "x", "choices": ["a"], "label": 1}) + "\n")
    assert main(["eval", f"hf:{exported}", "--task", str(bad)]) == 2
    assert _one_line(capsys) == f"kiln eval: error: {bad}:2: label 1 is out of range for 1 choice(s) (0 to 0)"
    assert main(["eval", str(tmp_path / "run" / "checkpoints" / "step_000100"), "--task", str(mc)]) == 2
    assert _one_line(capsys) == (f"kiln eval: error: {tmp_path / 'run'}: does not exist; pass a run directory "
                                 f"written by `kiln train`, one of its checkpoints (RUN_DIR/checkpoints/step_NNNNNN) "
                                 f"or hf:DIR")
    assert main(["eval", f"hf:{exported}", "--task", str(mc), "--max-length", "33", "--device", "cpu"]) == 2
    assert _one_line(capsys) == "kiln eval: error: --max-length=33 is longer than the model's max_seq_len 32"


def test_train_eval_tasks_log_the_scores_kiln_eval_gives(small_config, tasks, tmp_path, capsys):
    from kiln.run.lm import train

    mc, doc = tasks
    cfg = small_config(train={"max_steps": 3, "eval_tasks": (str(mc), f"text:{doc}"), "eval_task_limit": 3})
    result = train(cfg, tmp_path / "run")
    said = capsys.readouterr().out
    assert "eval task mc: 3 of 4 items (multiple_choice, 9 rows) at every evaluation\n" in said
    assert "eval task doc: 1 of 1 items (perplexity, " in said
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (final,) = [r for r in records if r["kind"] == "eval"]
    assert set(final) >= {"task_mc_acc", "task_mc_acc_norm", "task_mc_acc_stderr", "task_doc_bpb"}
    assert result.val_metrics["task_mc_acc"] == final["task_mc_acc"]
    assert main(["eval", str(tmp_path / "run"), "--task", str(mc), "--task", f"text:{doc}", "--limit", "3",
                 "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["checkpoint_step"] == 3
    assert final["task_mc_acc"] == saved["results"]["mc"]["acc,none"]
    assert final["task_mc_acc_norm"] == saved["results"]["mc"]["acc_norm,none"]
    assert final["task_doc_bpb"] == pytest.approx(saved["results"]["doc"]["bits_per_byte,none"], rel=1e-6)
    # a bad task file stops the run before its first step
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": []}\n')
    capsys.readouterr()
    assert main(["train", f"--data.source={cfg.data.source}", "--train.device=cpu", "--train.max_steps=2",
                 f"--train.eval_tasks=[\"{bad}\"]", f"--run-dir={tmp_path / 'bad-run'}", "--log.progress=off"]) == 2
    assert capsys.readouterr().err.strip() == (f"kiln train: error: {bad}:1: 'choices' is an empty choice list; "
                                               f"give at least one choice")
    assert not (tmp_path / "bad-run" / "checkpoints").exists()
