"""The examples run (--quick: a few steps) and print their result lines; their full output is in docs/library.md."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"(\d+\.\d+)"


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, encoding="utf-8",
                          timeout=120, env=os.environ | {"PYTHONIOENCODING": "utf-8"})


def run_example(name: str, run_dir: Path) -> str:
    """stdout of `python examples/NAME.py --quick --run-dir RUN_DIR`, which must succeed."""
    proc = python(f"examples/{name}.py", "--quick", "--run-dir", str(run_dir))
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def numbers(pattern: str, text: str) -> list[float]:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return [float(g) for g in match.groups()]


def test_mlp_regression(tmp_path):
    out = run_example("mlp_regression", tmp_path)
    [baseline] = numbers(rf"predict the mean\s+{NUMBER}", out)
    assert 0.3 < baseline < 0.8  # the variance of sin(x·w) + noise on the clean validation points
    for loss in ("mse", "huber"):
        mse, share = numbers(rf"MLP trained on {loss}\s+{NUMBER}\s+\({NUMBER}% of the mean's\)", out)
        assert 0 < mse < 10 and share == pytest.approx(100 * mse / baseline, abs=0.1)
        assert (tmp_path / loss / "metrics.jsonl").exists()


def test_digits_cnn(tmp_path):
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install 'kiln[examples]')")
    out = run_example("digits_cnn", tmp_path)
    [acc] = numbers(rf"test accuracy on 497 held-out digits: {NUMBER}% \(chance 10.0%\)", out)
    [loss] = numbers(rf"test loss \(label-smoothed cross-entropy\): {NUMBER} \(floor 0.5003", out)
    assert 0 <= acc <= 100 and 0.5 < loss < 5
    assert (tmp_path / "metrics.jsonl").exists()


def test_digits_cnn_without_scikit_learn_names_the_fix():
    code = ("import runpy, sys; sys.modules['sklearn'] = None; "  # None in sys.modules: `import sklearn` fails
            "runpy.run_path('examples/digits_cnn.py', run_name='__main__')")
    proc = python("-c", code)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["digits_cnn.py needs scikit-learn for its dataset: "
                                                "pip install 'kiln[examples]'"]


def test_contrastive(tmp_path):
    out = run_example("contrastive", tmp_path)
    for line in ("retrieval, view A → view B", "nearest-centroid clusters"):
        raw, random_init, trained = numbers(rf"{line}\s+{NUMBER}%\s+{NUMBER}%\s+{NUMBER}%", out)
        assert all(0 <= share <= 100 for share in (raw, random_init, trained))
    assert (tmp_path / "metrics.jsonl").exists()
