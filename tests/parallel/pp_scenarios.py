"""The pipeline-parallel runs tests/parallel/test_pipeline.py compares, built the same way in the test process (one
process, the reference) and in the torchrun workers (tests/parallel/pp_worker.py)."""
from pathlib import Path

from rich.console import Console

from kiln.config import load_config
from kiln.run.lm import build_lm
from kiln.train.checkpoint import Checkpointer
from tests.parallel.scenarios import lm_config

IGNORE = -100
SAMPLE = 24  # tokens sampled after a run
NAN_AT = "blocks.1.mlp@2"  # faults.nan_forward of the NaN-trace runs
# a rank's whole-step peak under pp2 × dp2 fsdp (1F1B, 2 micro-batches of 1 sequence), measured by the launch; the
# shape is tests/memory/test_rank_peak.py's (3 blocks: 2 on stage 0, 1 on stage 1)
PEAKS = {"fsdp fp32": ["--precision.mode=fp32"], "fsdp bf16": ["--precision.mode=bf16"]}


def peak_config(name: str):
    from tests.memory.test_rank_peak import SHAPE  # lazy: a test module (its fixtures) only where the peaks are

    return load_config(None, SHAPE + ["--parallel.pp=2", "--parallel.strategy=fsdp"] + PEAKS[name])


class MaskedLoader:
    """The run's loader with every target token whose id is divisible by 5 ignored: the micro-batches (and so the
    data-parallel ranks) hold different numbers of valid tokens, which the step must normalise globally."""

    def __init__(self, loader):
        self.loader = loader

    def next(self):
        x, y = self.loader.next()
        return x, y.masked_fill(y % 5 == 0, IGNORE)

    def __getattr__(self, name):  # batches_served, skip, state_dict, load_state_dict, close
        return getattr(self.loader, name)


def pp_config(source: str, *, arch: str = "gpt2", n_layer: int = 2, pp: int = 1, dp: int = 1, tp: int = 1,
              steps: int = 6, schedule: str = "1f1b", microbatches: int = 0, strategy: str | None = None,
              interval: int = 0, sequence_parallel: bool = False, nan_forward: str = "", nan_rank: int = -1):
    """fp32, global batch 8 sequences of 32 tokens (micro-batches of 4: 2 on one process, 1 per dp rank).
    nan_forward: a NaN planted there (faults.nan_forward, on rank nan_rank), the NaN trace on."""
    cfg = lm_config(source, strategy or ("ddp" if dp > 1 else "none"), steps=steps, nan_forward=nan_forward,
                    nan_rank=nan_rank, trace=bool(nan_forward))
    cfg.model.arch, cfg.model.n_layer = arch, n_layer
    if arch == "qwen3_moe":  # 8 experts of width 64, 2 per token; a balancing loss strong enough to be seen
        cfg.model.moe_aux_coef = 0.1
    cfg.train.cpu_linear = "torch"  # tp layouts' DTensor linears take F.linear; every layout and its reference too
    cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.pp_microbatches = pp, schedule, microbatches
    cfg.parallel.tp, cfg.parallel.sequence_parallel, cfg.checkpoint.interval = tp, sequence_parallel, interval
    return cfg


def with_lora(cfg):
    """cfg with rank-4 adapters on every block linear (Llama: q/k/v/o/gate/up/down), the base frozen."""
    cfg.lora.rank, cfg.lora.alpha, cfg.optim.lr = 4, 8.0, 1e-2
    return cfg


def pp_run(cfg, run_dir: Path, resume: bool = False, sample: int = 0):
    """Train cfg (resuming the run directory's latest checkpoint when asked) on the masked data; returns the state.
    sample: then draw that many tokens as `kiln train` does (rank 0 writes them to run_dir/sample.txt)."""
    cfg.train.sample_tokens = sample
    lm = build_lm(cfg, run_dir, log=lambda msg: None)
    lm.state.loader = MaskedLoader(lm.state.loader)
    trainer = lm.trainer(run_dir, Console(quiet=True))
    try:
        if resume:
            trainer.resume()
        text = lm.final_sample(trainer.run())
        if text is not None:
            (run_dir / "sample.txt").write_text(text)
    except BaseException:
        lm.state.world.broken = True  # the others may be inside a collective: no barrier to wait at
        raise
    finally:
        lm.state.world.close()
    return lm.state


def latest(run_dir: Path) -> Path:
    return Checkpointer(lm_config("", "none", 1).checkpoint, run_dir).latest()
