"""metrics.jsonl: every line carries a `kind` and the fields docs/training.md documents for it."""
import json
from dataclasses import replace

from kiln.models.config import param_count
from kiln.run.lm import train
from kiln.train.logging import KINDS

TRAIN_KEYS = {"kind", "step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens_seen",
              "peak_mem_bytes", "mfu", "hfu", "mfu_peak_flops", "clip_threshold", "utilisation", "skipped_steps",
              "loss_tokens"}


def test_every_record_has_a_kind_and_its_fields(small_config, tmp_path):
    cfg = small_config(train={"max_steps": 6, "eval_interval": 3}, log={"interval": 2},
                       faults={"nan_forward": "blocks.1.attn@4"})
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    # train, eval and numerics (the planted NaN) all occurred; of the event records, a one-process run writes the
    # layout (a restart and a straggler come from torchrun runs: tests/parallel/test_fleet.py)
    assert set(kinds) == set(KINDS)
    whole = 4 * param_count(replace(cfg.model, vocab_size=256).resolve())  # fp32, the bytes tokenizer's vocabulary
    assert [r for r in records if r["kind"] == "event"] == [
        {"kind": "event", "step": 0, "event": "layout", "mesh": {"dp": 1}, "strategy": "none",
         "sequence_parallel": False, "param_bytes_per_rank": [whole], "param_bytes_unsharded": whole}]
    for r in records:
        if r["kind"] == "train":
            assert set(r) == TRAIN_KEYS, set(r) ^ TRAIN_KEYS
        elif r["kind"] == "eval":
            # train_loss and gap: when finite train losses were logged since the previous evaluation
            assert {"kind", "step", "val_loss", "val_ppl"} <= set(r) <= {"kind", "step", "val_loss", "val_ppl",
                                                                         "train_loss", "gap"}
        else:
            assert {"kind", "step", "event"} <= set(r)
    # text windows: every target counts, so the step's counted targets are its tokens
    assert {r["loss_tokens"] for r in records if r["kind"] == "train"} == {
        cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len}
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    assert {r["event"] for r in records if r["kind"] == "numerics"} >= {"nonfinite", "nonfinite_trace"}
