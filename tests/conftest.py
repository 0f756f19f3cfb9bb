import os
import sysconfig
from pathlib import Path

import pytest
import torch

from kiln.config import make_config
from kiln.data import DataConfig
from kiln.models import ModelConfig


@pytest.fixture(scope="session", autouse=True)
def kiln_cache(tmp_path_factory):
    """Token shards of the whole suite go to a temporary cache, never the user's."""
    path = tmp_path_factory.mktemp("kiln-cache")
    os.environ["KILN_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """About 150 KB of real Python source: small enough for fast tests, real enough to learn from."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py",
                                                                "heapq.py", "copy.py", "csv.py"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text)
    return path


def small_model(**kw) -> ModelConfig:
    """A 2-layer, 64-wide GPT: trains in well under a second per step on a laptop core."""
    return ModelConfig(**({"preset": "tiny", "n_layer": 2, "n_head": 2, "d_model": 64, "max_seq_len": 64} | kw))


@pytest.fixture
def small_config(corpus_file, kiln_cache):
    """A complete run config over the test corpus: fp32, 32-token sequences, batch 4, logged every step."""

    def make(**sections):
        cfg = make_config(
            model=small_model(),
            data=DataConfig(source=str(corpus_file), seq_len=32, cache_dir=str(kiln_cache), prefetch=2),
        )
        cfg.train.max_steps, cfg.train.micro_batch_size, cfg.train.eval_batches = 10, 4, 4
        cfg.train.sample_tokens, cfg.train.device = 0, "cpu"
        cfg.precision.mode, cfg.log.interval, cfg.log.tensorboard = "fp32", 1, False
        cfg.log.progress, cfg.schedule.warmup_steps = "off", 2
        for name, values in sections.items():
            for key, value in values.items():
                setattr(getattr(cfg, name), key, value)
        return cfg

    return make


def requires_cuda(fn):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(pytest.mark.gpu(fn))


class LazyImport:
    """A module imported when a test first reads one of its names, skipping the test if it is not installed.

    For test references whose import pulls in Triton: `peft` imports torchao, which imports Triton. At collection
    that happens before tests/kernels/conftest.py sets TRITON_INTERPRET=1, and the kernel tests then fail inside
    Triton's interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel") when the whole suite runs."""

    def __init__(self, name: str, reason: str):
        self._name, self._reason = name, reason

    def __getattr__(self, attr):
        if attr.startswith("_"):  # pytest's collection asks every module-level name for its markers and fixtures
            raise AttributeError(attr)
        return getattr(pytest.importorskip(self._name, reason=self._reason), attr)
