"""Tensor parallelism composed with data parallelism on CPU with gloo: 4 processes (one torchrun launch,
tests/parallel/tp_worker.py) as tp2 × dp2 against 1 process, at the same global batch and seed, fp32, 6 steps, with
uneven valid-token counts across the data-parallel ranks (MaskedLoader). Both runs split the embedding, the head
and the loss over the vocabulary (GPT-2's tied matrix once, Llama's embedding and head each), as every tp > 1 run does.
The GPT-2 runs pack documents with the document mask (data.document_mask): each rank's heads attend inside them.

Tolerance 1e-5 relative: the 4-process run adds the same fp32 numbers in another order (row-parallel partial sums
all-reduced over tp, gradients reduced over dp) which moves the last bits of each step (~1e-7); AdamW carries them
forward over 6 steps. A real error is orders of magnitude larger: a fused weight split as one block (rank 0 gets all
of q) changes the model's function at step 1, and tokens counted on each tp rank halve every gradient.
"""

import pytest
import torch

from kiln.models.registry import family
from kiln.run import lm
from kiln.run.lm import train
from tests.parallel.conftest import final_weights, one_thread
from tests.parallel.scenarios import MaskedLoader, rewound, tp_config
from tests.parallel.task_scenarios import assert_tasks_score_as_one_process
from tests.parallel.test_dist import losses, records

RTOL = 1e-5


def assert_same_run(got_dir, want_dir):
    got, want = losses(got_dir), losses(want_dir)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=RTOL), step
    wg, ww = final_weights(got_dir), final_weights(want_dir)
    assert wg.keys() == ww.keys()
    # the consolidated export is in the model's own row order (fused rows put back). Weights to 1e-5 absolute, as
    # tests/parallel/test_dist.py's MoE parity: AdamW turns the last-bit differences of a gradient near optim.eps
    # into a larger step (its update is ~lr whatever the gradient's size). Measured on the 2-core Intel Xeon with AMX
    # (2026-11-27): llama_fsdp's blocks.0.mlp.proj.weight 1.17e-6 off in one element, every other tensor ≤ 6.1e-7;
    # a wrong split or normalisation moves the losses above by far more than their 1e-5.
    for key in ww:
        torch.testing.assert_close(wg[key], ww[key], rtol=RTOL, atol=1e-5, msg=key)


@pytest.mark.parametrize("run,arch", [("llama_fsdp", "llama"), ("gpt2_ddp_sp", "gpt2"), ("moe_fsdp_sp", "qwen3_moe")])
def test_tp2_dp2_trains_as_one_process(tp_launched, tp_reference, run, arch):
    assert_same_run(tp_launched / run, tp_reference / arch)
    got, want = records(tp_launched / run, "eval"), records(tp_reference / arch, "eval")
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=RTOL)  # evaluation over dp, not tp


@pytest.mark.parametrize("run", ["gpt2_ddp_sp", "llama_dp2_cp2"])
def test_eval_tasks_score_as_one_process(tp_launched, run):
    """train.eval_tasks through the validation forward of tp2 × dp2 with sequence parallelism (the head's vocabulary
    split over the tp ranks) and of dp2 × cp2 (each row's positions over the cp ranks): the scores of the final
    checkpoint in one process."""
    with one_thread():
        assert_tasks_score_as_one_process(tp_launched, tp_launched / run, records(tp_launched / run, "eval")[-1])


def test_the_reference_sees_uneven_valid_counts(source, kiln_cache, tmp_path):
    """The masking makes the dp ranks' shares of a step differ (else the normalisation would not be tested)."""
    cfg = tp_config(source, "llama", "none", tp=1, steps=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm, "TokenLoader", MaskedLoader)
        run = lm.build_lm(cfg, tmp_path, log=lambda m: None)
    batches = [run.state.loader.next() for _ in range(4)]
    run.state.loader.close()
    counts = [int((b[1] != -100).sum()) for b in batches]
    assert counts[0] + counts[2] != counts[1] + counts[3]  # dp rank 0 takes stream batches 0, 2; rank 1 takes 1, 3


def test_a_tp_checkpoint_resumes_in_one_process(tp_launched, tp_reference, tmp_path, source):
    """tp2 × dp2 (fsdp) saved at step 3, resumed by one process (no torchrun) to step 6: the straight curve."""
    run_dir = rewound(tp_launched / "llama_fsdp", tmp_path / "resumed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm, "TokenLoader", MaskedLoader)
        train(tp_config(source, "llama", "ddp", tp=1, steps=6), run_dir, resume=True)
    assert_same_run(run_dir, tp_reference / "llama")


def test_an_fsdp_checkpoint_resumes_under_tp(tp_launched, tp_reference):
    """fsdp × 4 for 3 steps, then tp2 × dp2 to step 6 (the fused rows reordered on load): the straight curve."""
    assert_same_run(tp_launched / "fsdp_to_tp", tp_reference / "llama")


def expected_bytes(arch: str, tp: int, dp: int, vocab: bool = True) -> int:
    """One rank's parameter bytes from the family's description: column and row linears hold 1/tp, the embedding and
    an untied head 1/tp of the padded vocabulary's rows (vocab=False: whole, the layout before vocabulary
    parallelism), everything else is whole on each tp rank; FSDP holds 1/dp of that (every size here divides)."""
    cfg = tp_config("", arch, "none", tp=1, steps=1).model
    cfg.vocab_size = cfg.vocab_size or 256  # the byte tokenizer's
    cfg = cfg.resolve()
    fam = family(cfg.arch)
    roles = {lin.name: lin.tp for lin in fam.linears(cfg)}
    total = 0
    for name, shape in fam.parameter_shapes(cfg):
        numel = torch.Size(shape).numel()
        module, _, kind = name.split(".", 2)[-1].rpartition(".") if name.startswith("blocks.") else ("", "", "")
        split = roles.get(module) == "column" or (roles.get(module) == "row" and kind == "weight")  # row bias: whole
        split = split or (vocab and name in ("embed.weight", "head.weight"))
        total += numel // tp if split else numel
    return 4 * total // dp


@pytest.mark.parametrize("run,arch,dp_shards", [("llama_fsdp", "llama", 2), ("gpt2_ddp_sp", "gpt2", 1)])
def test_the_layout_event_shows_the_split(tp_launched, run, arch, dp_shards):
    """Each rank holds 1/tp of the block linears and of the vocabulary: GPT-2's tied [256, 64] matrix once, Llama's
    embedding and head both, so a rank holds 256·64·4 bytes × (1 or 2 matrices) × (1 - 1/tp) / dp less than with
    them replicated."""
    events = [e for e in records(tp_launched / run, "event") if e["event"] == "layout"]
    assert len(events) == 1
    event = events[0]
    assert event["mesh"] == {"pp": 1, "dp": 2, "tp": 2}
    held = event["param_bytes_per_rank"]
    assert len(held) == 4 and all(b < event["param_bytes_unsharded"] for b in held)
    assert held == [expected_bytes(arch, tp=2, dp=dp_shards)] * 4
    vocab_matrices = 1 if arch == "gpt2" else 2
    saved = expected_bytes(arch, tp=2, dp=dp_shards, vocab=False) - held[0]
    assert saved == 256 * 64 * 4 * vocab_matrices // 2 // dp_shards
    assert event["param_bytes_unsharded"] == expected_bytes(arch, tp=1, dp=1)


def test_sample_and_export_read_a_tp_run(tp_launched, tp_reference, tmp_path):
    """`kiln sample` and `kiln export` read a tensor-parallel run's consolidated weights (model's own order): the
    same text as the one-process run's, and Hugging Face tensors that load back."""
    from kiln.interop.hf import read_hf
    from kiln.cli.main import main
    from kiln.run.sample import sample_from_run

    got = sample_from_run(tp_launched / "llama_fsdp", "def ", 20, 0.0, 0, device="cpu")
    assert got == sample_from_run(tp_reference / "llama", "def ", 20, 0.0, 0, device="cpu")
    assert main(["export", str(tp_launched / "llama_fsdp"), "--hf", str(tmp_path / "hf")]) == 0
    _, tensors = read_hf(tmp_path / "hf")
    want = final_weights(tp_reference / "llama")
    torch.testing.assert_close(tensors["blocks.0.attn.qkv.weight"], want["blocks.0.attn.qkv.weight"], rtol=RTOL,
                               atol=1e-6)


def test_the_gpt2_runs_pack_documents(source, kiln_cache, tmp_path):
    """The GPT-2 scenario's batches carry documents that split windows (else the mask under TP would not be tested)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm, "TokenLoader", MaskedLoader)
        run = lm.build_lm(tp_config(source, "gpt2", "none", tp=1, steps=1), tmp_path, log=lambda m: None)
    batches = [run.state.loader.next() for _ in range(4)]
    run.state.loader.close()
    assert all(len(b) == 3 for b in batches) and sum(int(b[2].max()) for b in batches) >= 2
