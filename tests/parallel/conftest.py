"""What the distributed tests share: the corpus, the 2-process launch, and the one-process reference runs."""
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.run import lm
from kiln.run.lm import train
from tests.parallel.scenarios import MaskedLoader, fit_run, lm_config, lora_config, moe_config, muon_config, tp_config
from tests.train.test_golden_curve import corpus_text

ROOT = Path(__file__).resolve().parents[2]


def torchrun(worker: str, out: Path, source, nproc: int, timeout: int = 600) -> float:
    """Launch tests/parallel/WORKER on `nproc` gloo ranks (one thread each) with `out` and `source`; it must exit 0.
    Its console output is kept in OUT/WORKER.log. Returns the launch's wall seconds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(ROOT / "tests" / "parallel" / worker), str(out), str(source)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (out / f"{worker}.log").write_text(proc.stdout)
    return time.monotonic() - began


@contextlib.contextmanager
def one_thread():
    """One-process reference runs on one thread, as each torchrun rank runs (torch's products sum in another order
    on more threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def final_weights(run_dir):
    """The latest checkpoint's consolidated weights of a run."""
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(latest / "model.safetensors"))


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
def moe_reference(tmp_path_factory, source, kiln_cache):
    """tests/parallel/worker.py's mixture of experts (scenarios.moe_config) in this one process, on one thread as
    each torchrun rank runs (torch's products sum in another order on more threads)."""
    out = tmp_path_factory.mktemp("single-moe") / "moe"
    with one_thread():
        train(moe_config(source, "none"), out)
    return out


@pytest.fixture(scope="session")
def muon_reference(tmp_path_factory, source, kiln_cache):
    """tests/parallel/worker.py's Muon run (scenarios.muon_config) in this one process, on one thread as each
    torchrun rank runs."""
    out = tmp_path_factory.mktemp("single-muon") / "muon"
    with one_thread():
        train(muon_config(source, "none"), out)
    return out


@pytest.fixture(scope="session")
def lora_reference(tmp_path_factory, source, kiln_cache):
    """tests/parallel/worker.py's LoRA runs (scenarios.lora_config) in this one process, on one thread as each
    torchrun rank runs."""
    out = tmp_path_factory.mktemp("single-lora")
    with one_thread():
        for mode in ("fp32", "bf16"):
            train(lora_config(source, "none", mode), out / mode)
    return out


@pytest.fixture(scope="session")
def launched(tmp_path_factory, source, kiln_cache):
    """One torchrun launch of tests/parallel/worker.py: every 2-process scenario."""
    out = tmp_path_factory.mktemp("dist")
    for strategy in ("fsdp", "zero1"):  # one process writes 5 steps; the launch resumes them on 2 ranks
        train(lm_config(source, "none", steps=5), out / f"from_one_{strategy}")
    torchrun("worker.py", out, source, nproc=2, timeout=300)
    return out


@pytest.fixture(scope="session")
def tp_reference(tmp_path_factory, source, kiln_cache):
    """tp_worker.py's runs in this one process (4 micro-batches of 2 where each dp rank takes 2), with its uneven
    valid-token counts (test_tensor_parallel.py, test_context_parallel.py)."""
    out = tmp_path_factory.mktemp("tp-single")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm, "TokenLoader", MaskedLoader)
        for arch in ("llama", "gpt2", "qwen3_moe"):
            train(tp_config(source, arch, "none", tp=1, steps=6), out / arch)
    return out


@pytest.fixture(scope="session")
def tp_launched(tmp_path_factory, source, kiln_cache):
    """One torchrun launch of tests/parallel/tp_worker.py on 4 processes (test_tensor_parallel.py,
    test_fit_tensor_parallel.py); its wall time is printed (-s shows it)."""
    out = tmp_path_factory.mktemp("tp")
    print(f"tensor-parallel launch: {torchrun('tp_worker.py', out, source, nproc=4):.1f} s")
    return out
