"""A run whose loss is non-finite from the start, or at its end, does not exit 0."""
import math

from kiln.cli.main import main
from kiln.config import to_toml
from kiln.numerics.outcome import NONFINITE_EXIT, LossWatch


def _watch(losses, start=1):
    watch = LossWatch()
    for step, loss in enumerate(losses, start=start):
        watch.observe(step, loss)
    return watch


def test_loss_watch_names_what_went_non_finite():
    nan = math.nan
    assert _watch([3.0, 2.9, 2.8]).failure(2.7, "max_steps") is None
    assert _watch([3.0, nan, 2.8]).failure(2.7, "max_steps") is None  # one skipped step, recovered
    assert _watch([nan, nan, nan]).failure(nan, "max_steps").startswith(
        "the loss was non-finite (nan) at every logged step (steps 1-3): nothing was learned")
    assert _watch([3.0, 2.9, math.inf]).failure(2.7, "max_steps").startswith(
        "the run ended on a non-finite loss (inf) at step 3, the last logged")
    assert _watch([3.0, 2.9]).failure(nan, "max_steps").startswith("the final validation loss is nan")
    stop = "numerics: 6 non-finite steps in a row up to step 9 (numerics.max_nonfinite_steps=6)"
    assert _watch([3.0, nan]).failure(None, stop).startswith("the run stopped on non-finite steps (6 non-finite")
    assert _watch([]).failure(None, "max_steps") is None


def test_kiln_train_exits_non_zero_when_the_loss_is_nan_from_the_start(small_config, tmp_path, capsys):
    path = tmp_path / "nan.toml"
    path.write_text(to_toml(small_config(train={"max_steps": 3, "sample_tokens": 20},
                                         faults={"nan_forward": "blocks.0.mlp@1-3"})))
    code = main(["train", str(path), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == NONFINITE_EXIT == 4
    assert err.startswith("kiln train: error: the loss was non-finite (nan) at every logged step (steps 1-3)")
    assert "nonfinite_report.json" in err
    assert (tmp_path / "run" / "checkpoints" / "step_000003").is_dir()  # kept for the post-mortem
