"""`kiln memory`: which files it writes."""
from kiln.cli.main import main

SMALL = ["--model.n_layer=2", "--model.d_model=64", "--model.n_head=2", "--data.seq_len=32",
         "--train.micro_batch_size=2", "--train.device=cpu", "--precision.mode=fp32"]


def test_an_empty_out_path_writes_no_file(tmp_path, monkeypatch, capsys):
    """--out '' means no chart: with --measure, not the timeline either (it used to land in ./memory-timeline.png)."""
    monkeypatch.chdir(tmp_path)
    assert main(["memory", *SMALL, "--measure", "--steps", "1", "--out", ""]) == 0
    out = capsys.readouterr().out
    assert "measured peak:" in out and "wrote " not in out
    assert list(tmp_path.iterdir()) == []
    # An explicit --timeline is still written, alone.
    assert main(["memory", *SMALL, "--measure", "--steps", "1", "--out=", "--timeline", "t.png"]) == 0
    assert "wrote t.png" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]
