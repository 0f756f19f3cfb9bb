"""`kiln data show`: batches decoded the way the model sees them, and the data's statistics, checked against the
loader and numpy."""
import numpy as np
import pytest

from kiln.cli.main import main
from kiln.data import TokenLoader, prepare_data
from kiln.run.data_show import EOT, IGNORED, aligned, cell, show, statistics


def test_statistics_match_numpy(small_config):
    cfg = small_config()
    data = prepare_data(cfg.data, None, log=lambda m: None)
    stats = statistics(data)
    ids, counts = np.unique(np.asarray(data.train), return_counts=True)
    assert stats.used == len(ids) and stats.train_tokens == len(data.train) and stats.documents == 1
    top_id = ids[np.argmax(counts)]
    assert stats.top[0] == (cell(data.tokenizer, int(top_id)), pytest.approx(counts.max() / counts.sum()))


def test_each_target_is_the_next_columns_input(small_config):
    cfg = small_config()
    lines = show(cfg, batches=2, rows=3, positions=24, log=lambda m: None)
    grids = [(a, b) for a, b in zip(lines, lines[1:]) if a.startswith("  in  │") and b.startswith("  tgt │")]
    assert len(grids) == 6  # 2 batches × 3 rows, each 24 positions on one line
    for row_in, row_out in grids:
        ins, outs = row_in.split("│")[1:-1], row_out.split("│")[1:-1]
        assert len(ins) == len(outs) == 24
        assert [o.strip() for o in outs[:-1]] == [i.strip() for i in ins[1:]]  # shifted by one, column by column
    data = prepare_data(cfg.data, None, log=lambda m: None)
    x, y = TokenLoader(data.train, cfg.train.micro_batch_size, cfg.data.seq_len, cfg.data.seed, "cpu",
                       prefetch=0).next()
    first = grids[0][0].split("│")[1:-1]
    assert [c.strip() for c in first] == [cell(data.tokenizer, t) for t in x[0, :24].tolist()]  # the loader's batch


def test_boundaries_and_ignored_targets_are_marked(small_config):
    data = prepare_data(small_config().data, None, log=lambda m: None)
    tok = data.tokenizer
    text = [tok.encode("ab")[0], tok.eot_id, tok.encode(" ")[0]]
    row_in, row_out = aligned(tok, text, [tok.eot_id, tok.encode("\n")[0], -100])
    assert row_in == f"  in  │a│{EOT}│·│" and row_out == f"  tgt │{EOT}│⏎│{IGNORED}│"


def test_kiln_data_show_prints_and_refuses_bad_counts(small_config, capsys):
    cfg = small_config()
    args = ["data", "show", f"--data.source={cfg.data.source}", f"--data.cache_dir={cfg.data.cache_dir}",
            "--data.seq_len=32", "--model.max_seq_len=64"]
    assert main(args + ["--rows=1", "--positions=8"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary used" in out and "batch 1 (8 × 32 tokens)" in out and out.count("  in  │") == 1
    assert main(args + ["--batches=0"]) == 2
    assert "--batches must be ≥ 1" in capsys.readouterr().err
