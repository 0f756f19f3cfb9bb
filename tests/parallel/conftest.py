"""What the distributed tests share: the corpus, the 2-process launch, and the one-process reference runs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.run.lm import train
from tests.parallel.scenarios import fit_run, lm_config
from tests.train.test_golden_curve import corpus_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist-corpus") / "corpus.txt"
    path.write_text(corpus_text())
    return str(path)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, source, kiln_cache):
    """The same runs in this one process, without data parallelism (2 micro-batches where 2 ranks take 1 each)."""
    out = tmp_path_factory.mktemp("single")
    train(lm_config(source, "none", steps=10), out / "lm")
    fit_run("none", out / "fit")
    return out


@pytest.fixture(scope="session")
def launched(tmp_path_factory, source, kiln_cache):
    """One torchrun launch of tests/parallel/worker.py: every 2-process scenario."""
    out = tmp_path_factory.mktemp("dist")
    for strategy in ("fsdp", "zero1"):  # one process writes 5 steps; the launch resumes them on 2 ranks
        train(lm_config(source, "none", steps=5), out / f"from_one_{strategy}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "parallel" / "worker.py"), str(out), source],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out
