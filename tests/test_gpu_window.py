"""benchmarks/gpu_window.sh: the suite started detached, a call that returns while it runs, a later call that
finds it finished, and one tarball holding every part's results (the device tool returns at most 8 files)."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A dry run of the suite's profile part through the window script (78 s on the loaded 2-core Xeon): `make gpu-preflight`
# runs this file before a GPU window, `make test` leaves it out (docs/testing.md).
pytestmark = pytest.mark.gpu_preflight


def window(verb: str, tmp_path: Path, wait_s: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PY=sys.executable, RESULTS=str(tmp_path / "dev" / "gpu-results"), OUT=str(tmp_path / "out"),
               WAIT_S=str(wait_s), SUITE_ARGS="--dry-run --parts profile")
    return subprocess.run(["bash", "benchmarks/gpu_window.sh", verb], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_start_returns_while_running_then_wait_packs_the_finished_run(tmp_path):
    first = window("start", tmp_path, wait_s=0)
    assert first.returncode == 0, first.stderr
    assert "suite started" in first.stdout and "call 'wait' again" in first.stdout
    assert (tmp_path / "dev" / "repo" / "benchmarks" / "gpu_suite.py").is_file()  # it runs from a copy of the tree
    assert not (tmp_path / "dev" / "repo" / ".venv").exists()
    second = window("wait", tmp_path, wait_s=240)
    assert second.returncode == 0, second.stderr
    assert "suite finished" in second.stdout
    with tarfile.open(tmp_path / "out" / "gpu-results.tgz") as tar:
        names = set(tar.getnames())
        assert {"gpu-results/profile.json", "gpu-results/summary.json", "gpu-results/suite.log"} <= names
        profile = json.load(tar.extractfile("gpu-results/profile.json"))
        summary = json.load(tar.extractfile("gpu-results/summary.json"))
    assert profile["dry_run"] is True and profile["summary"]["step_s"] > 0
    assert summary["parts"] == {"profile": "done"}


def test_wait_without_a_run_says_start_again(tmp_path):
    proc = window("wait", tmp_path, wait_s=1)
    assert proc.returncode == 1 and "start again" in proc.stdout


def test_unknown_verb_prints_usage(tmp_path):
    proc = window("go", tmp_path, wait_s=1)
    assert proc.returncode == 2 and "usage:" in proc.stderr
