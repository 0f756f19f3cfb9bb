"""Pipeline parallelism on CPU with gloo, alone and with tensor parallelism inside each stage (tp2 × pp2): one
torchrun launch of 4 processes against one process, fp32, 6 steps, the same global batch (8 sequences) and seed, with
a fifth of the target tokens ignored so that the ranks' micro-batches hold different numbers of valid tokens.

Tolerance 1e-5 relative (the issue's): the runs add the same fp32 numbers in another order (micro-batches of 2
sequences instead of 4, DDP's all-reduce, the gradient norm as a sum of the stages' squares, TP's row-parallel partial
sums), which moves the last bits of each step: losses and gradient norms measured within 3e-7 relative over 6 steps;
weights within 4e-6 absolute (a few of 16k elements, where AdamW's division by sqrt(v) of a near-zero gradient
amplifies those bits). A real error — the loss normalised per stage or per micro-batch, a tied gradient not summed
(or summed with another tp rank's), a stage missing from the norm, a tp shard counted twice in it — moves step 2's
loss by 1e-3 or more.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.memory.devices import get_device
from kiln.memory.estimate import estimate, peak_allocated, rank_state
from kiln.memory.levers import rank_jobs
from kiln.models import ModelConfig, build_model
from kiln.models.moe import moe_losses
from kiln.models.registry import family
from kiln.parallel import ParallelConfig
from kiln.parallel.layout import ParallelPlan
from kiln.numerics.trace import REPORT_FILE
from kiln.parallel.pipeline import PipelineModel
from tests.parallel.conftest import one_thread, torchrun
from tests.parallel.pp_scenarios import NAN_AT, PEAKS, SAMPLE, latest, peak_config, pp_config, pp_run, with_lora
from tests.parallel.scenarios import rewound
from tests.parallel.task_scenarios import assert_tasks_score_as_one_process

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-5
ATOL = 1e-5  # weights: AdamW divides by sqrt(v), so where a gradient is ~0 its last bits move the update (~1e-6)


@pytest.fixture(scope="module")
def single(tmp_path_factory, source, kiln_cache):
    """The one-process references (GPT-2's sampled after training), and the NaN trace of one process."""
    out = tmp_path_factory.mktemp("pp-single")
    for name, kw in (("gpt2", {}), ("llama", {"arch": "llama"}), ("gpt2_4", {"n_layer": 4}),
                     ("qwen3_moe", {"arch": "qwen3_moe"})):
        pp_run(pp_config(source, **kw), out / name, sample=SAMPLE if name == "gpt2" else 0)
    pp_run(pp_config(source, steps=2, nan_forward=NAN_AT), out / "nan_trace")
    pp_run(with_lora(pp_config(source, arch="llama")), out / "llama_lora")
    return out


@pytest.fixture(scope="module")
def pp_launched(tmp_path_factory, single, source):
    out = tmp_path_factory.mktemp("pp")
    pp_run(pp_config(source, steps=3, strategy="ddp"), out / "from_one")
    pp_run(pp_config(source, arch="llama", steps=3, strategy="ddp"), out / "tp2pp2_llama")  # resumed under tp2 × pp2
    seconds = torchrun("pp_worker.py", out, source, nproc=4)
    (out / "launch_seconds.txt").write_text(f"{seconds:.1f}")
    return out


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def assert_same_curve(got: Path, want: Path):
    a, b = records(got, "train"), records(want, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))  # one writer: no line twice
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=RTOL), x["step"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=RTOL), x["step"]  # over every stage
        # counted once per data-parallel copy, not per stage; global across a resume on another world size
        assert x["tokens_seen"] == y["tokens_seen"]


def assert_same_weights(got: Path, want: Path):
    a, b = (load_file(str(latest(p) / "model.safetensors")) for p in (got, want))
    assert a.keys() == b.keys()  # every stage's weights gathered, under the full model's names
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("strategy, arch", [("ddp", "gpt2"), ("fsdp", "gpt2"), ("fsdp", "llama")])
def test_pp2_dp2_1f1b_trains_as_one_process(pp_launched, single, strategy, arch):
    """Each stage's data-parallel copies under DDP, or FSDP2 (the stage's blocks and then the stage sharded over dp;
    GPT-2's tied embedding sharded on both ends and its two gradients summed shard by shard)."""
    run = pp_launched / f"pp2dp2_{strategy}_{arch}"
    assert_same_curve(run, single / arch)
    assert_same_weights(run, single / arch)
    got, want = records(run, "eval")[-1]["val_loss"], records(single / arch, "eval")[-1]["val_loss"]
    assert got == pytest.approx(want, rel=RTOL)  # evaluation through the schedule's forward-only path


def test_eval_tasks_through_the_pipeline_score_as_one_process(pp_launched):
    """train.eval_tasks under pp2 × dp2: each copy's rows through the schedule's forward-only path, the
    log-likelihoods from the last stage; the scores of the final checkpoint in one process."""
    run = pp_launched / "pp2dp2_ddp_gpt2"
    with one_thread():
        assert_tasks_score_as_one_process(pp_launched, run, records(run, "eval")[-1])


def test_lora_under_pp2_dp2_fsdp_trains_as_one_process(pp_launched, single):
    """LoRA adapters inside the pipeline's stages (Llama's q/k/v/o/gate/up/down pieces), each stage's frozen base and
    adapters sharded by FSDP2 over its copies: the one-process curve and weights."""
    run = pp_launched / "pp2dp2_fsdp_llama_lora"
    assert_same_curve(run, single / "llama_lora")
    assert_same_weights(run, single / "llama_lora")
    base = load_file(str(latest(single / "llama") / "model.safetensors"))  # the same model without adapters
    weights = load_file(str(latest(run) / "model.safetensors"))
    assert {k for k in weights if ".lora_" not in k} == set(base) and len(weights) == len(base) + 2 * 7 * 2
    assert any(float(weights[k].abs().max()) > 0 for k in weights if ".lora_B." in k)


def test_each_rank_holds_its_stage_only(pp_launched):
    held = [json.loads((pp_launched / f"held_rank{r}.json").read_text()) for r in range(4)]
    first, last = held[0]["gpt2"], held[2]["gpt2"]  # ranks 0, 1: stage 0; ranks 2, 3: stage 1 (pp outermost)
    assert held[1] == held[0] and held[3] == held[2]  # the data-parallel copies hold the same
    assert {k.split(".")[1] for k in first if k.startswith("blocks.")} == {"0"}
    assert {k.split(".")[1] for k in last if k.startswith("blocks.")} == {"1"}
    assert "pos_embed.weight" in first and "norm.weight" in last and "norm.weight" not in first
    assert "embed.weight" in first and "embed.weight" in last  # GPT-2's tied weight: both ends hold it
    assert "head.weight" in held[2]["llama"] and "embed.weight" not in held[2]["llama"]  # Llama's head is its own


@pytest.mark.parametrize("run", ["interleaved", "gpipe4"])
def test_interleaved_and_gpipe_on_four_blocks(pp_launched, single, run):
    """interleaved_1f1b: 4 virtual stages on 2 ranks × 2 copies, 4 micro-batches; gpipe: 4 stages, 1 copy."""
    assert_same_curve(pp_launched / run, single / "gpt2_4")
    assert_same_weights(pp_launched / run, single / "gpt2_4")


def continue_on_one_process(launched_run: Path, run: Path, source) -> Path:
    """A copy of a launched run, resumed on one process from its step-3 checkpoint to step 6."""
    rewound(launched_run, run)
    pp_run(pp_config(source, strategy="ddp"), run, resume=True)
    return run


def test_resharded_resume_continues_the_curve(pp_launched, single, source, tmp_path):
    """One process (3 steps) → pp2 × dp2 fsdp (to 6), and pp2 × dp2 fsdp (saved at step 3) → one process (to 6): DCP
    by full names, from and into FSDP2's shards of each stage."""
    assert_same_curve(pp_launched / "from_one", single / "gpt2")
    assert_same_weights(pp_launched / "from_one", single / "gpt2")
    run = continue_on_one_process(pp_launched / "pp2dp2_fsdp_gpt2", tmp_path / "to_one", source)
    assert_same_curve(run, single / "gpt2")
    assert_same_weights(run, single / "gpt2")


def test_a_pp_run_samples_as_one_process(pp_launched, single):
    """The sample at the end of a run under pp2 × dp2 fsdp: every stage's weights gathered to rank 0, which samples
    alone; the same text as one process's (the same weights within 1e-6, the same seed)."""
    got = (pp_launched / "pp2dp2_fsdp_gpt2" / "sample.txt").read_text()
    assert got == (single / "gpt2" / "sample.txt").read_text()
    assert got.startswith(pp_config("").train.sample_prompt) and len(got) > len(pp_config("").train.sample_prompt)


def test_the_nan_trace_finds_a_stage_s_nan_as_one_process_does(pp_launched, single):
    """A NaN planted in block 1's MLP output (held by stage 1, on rank 2) at step 2 under pp2 × dp2: the step is
    replayed in one piece on a copy gathered to rank 0, whose report names the module, op and phase one process's
    trace names."""
    got = json.loads((pp_launched / "nan_trace" / REPORT_FILE).read_text())
    want = json.loads((single / "nan_trace" / REPORT_FILE).read_text())
    assert got["reproduced"] and want["reproduced"]
    assert (got["module"], got["phase"], got["step"]) == (NAN_AT.split("@")[0], "forward", 2)
    for key in ("module", "op", "phase", "step", "micro_batch", "nonfinite_parameters"):
        assert got[key] == want[key], key
    assert got["rank"] == 0
    (event,) = [r for r in records(pp_launched / "nan_trace", "numerics") if r.get("event") == "nonfinite_trace"]
    assert event["module"] == got["module"]


def stage_bytes(arch: str, tp: int) -> tuple[list[int], int]:
    """(parameter bytes of each of 2 stages as one tp rank holds them, the whole model's): block i on stage i, the
    embeddings on the first (GPT-2's tied one on the last too), the final norm and head on the last; a column
    linear's weight and bias, a row linear's weight and the embedding's and head's vocabulary rows 1/tp,
    everything else whole on every tp rank."""
    cfg = pp_config("", arch=arch).model
    cfg.vocab_size = cfg.vocab_size or 256  # the byte tokenizer's
    model = build_model(cfg.resolve(), "cpu")
    roles = {lin.name: lin.tp for lin in family(cfg.arch).linears(model.cfg)}
    stages, whole = [0, 0], 0
    for name, p in model.named_parameters():
        whole += 4 * p.numel()
        top, _, rest = name.partition(".")
        if top == "blocks":
            i, _, rest = rest.partition(".")
            module, _, kind = rest.rpartition(".")
            split = roles.get(module) == "column" or (roles.get(module) == "row" and kind == "weight")
            stages[int(i)] += 4 * p.numel() // (tp if split else 1)
        else:
            owners = {"embed": [0, 1] if model.head is None else [0], "pos_embed": [0]}.get(top, [1])
            for s in owners:
                stages[s] += 4 * p.numel() // (tp if top in ("embed", "head") else 1)
    return stages, whole


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fsdp_stage_bytes_are_the_estimators(pp_launched, arch):
    """pp2 × dp2 under FSDP2: every rank's parameter bytes as held (the layout event) are what the estimator predicts
    for its stage (kiln memory --ranks 4 --parallel.pp=2 --parallel.strategy=fsdp), and that is half of the stage's
    bytes split by hand (each weight's rows over the 2 copies: every first dim here is even)."""
    (event,) = [e for e in records(pp_launched / f"pp2dp2_fsdp_{arch}", "event") if e["event"] == "layout"]
    cfg = pp_config("", arch=arch, pp=2, dp=2, strategy="fsdp")
    cfg.model.vocab_size = 256  # the byte tokenizer's
    plan, jobs = rank_jobs(cfg, get_device("H100"), 4)
    predicted = [rank_state(jobs[plan.coords(r)["pp"]])["parameters"] for r in range(4)]
    assert event["param_bytes_per_rank"] == predicted
    (first, last), _ = stage_bytes(arch, tp=1)
    assert predicted == [first // 2, first // 2, last // 2, last // 2]


@pytest.mark.parametrize("name", list(PEAKS))
def test_pp2_dp2_fsdp_rank_peaks_match_the_estimate(pp_launched, name):
    """Each stage's whole-step peak under pp2 × dp2 fsdp (steady state: the least of 3 later steps), within the
    single-process tolerance (5%) of its estimate: torch's pipeline keeps FSDP2's gradients whole and its blocks
    gathered until the step's last backward, which the per-block reduce-scatter of plain FSDP2 would put 6-7% over
    (fp32), and the last stage gathers its block again through gloo's staging copy in the second micro-batch's
    backward. The two copies of a stage hold the same."""
    measured = [json.loads((pp_launched / f"peaks_rank{r}.json").read_text())[name] for r in range(4)]
    plan, jobs = rank_jobs(peak_config(name), get_device("cpu"), 4)
    for rank in range(4):
        b = estimate(jobs[plan.coords(rank)["pp"]])
        assert peak_allocated(b) == pytest.approx(min(measured[rank][1:]), rel=0.05), rank


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3_moe"])
def test_tp2_pp2_trains_as_one_process(pp_launched, single, arch):
    """Tensor parallel inside each pipeline stage (dp 1): GPT-2 with sequence parallelism from step 1, Llama from one
    process's checkpoint at step 3 (its fused rows into the TP order on load). The same curve, weights and val_loss as
    one process, and the layout event shows each rank holding half of its stage's block linears. Qwen3-MoE: whole
    MoE blocks per stage, its router and experts whole on each tp rank."""
    run = pp_launched / f"tp2pp2_{arch}"
    assert_same_curve(run, single / arch)
    assert_same_weights(run, single / arch)  # gathered over tp and pp, fused rows in the model's order
    got, want = records(run, "eval")[-1]["val_loss"], records(single / arch, "eval")[-1]["val_loss"]
    assert got == pytest.approx(want, rel=RTOL)
    event = [e for e in records(run, "event") if e["event"] == "layout"][-1]  # llama: resumed from one process
    assert event["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and event["sequence_parallel"] == (arch == "gpt2")
    (first, last), whole = stage_bytes(arch, tp=2)
    assert event["param_bytes_per_rank"] == [first, first, last, last]  # ranks 0, 1: stage 0 (tp innermost)
    assert event["param_bytes_unsharded"] == whole


def test_a_pipeline_pools_the_load_balancing_loss_over_its_stages(pp_launched, single):
    """The MoE's load-balancing loss is E·Σ f_e·P_e over both stages' blocks together (not a sum of per-stage
    losses): the record's moe_aux_loss and load shares are one process's, step by step, as is the objective (the test above).
    The check can tell them apart: the sum of the two stages' own losses (each stage's E·Σ f_e·P_e over its blocks)
    is about twice the pooled one; their mean is closer, 1e-4-2e-3 relative at initialisation (seed-dependent)."""
    got, want = records(pp_launched / "tp2pp2_qwen3_moe", "train"), records(single / "qwen3_moe", "train")
    for x, y in zip(got, want):
        for key in ("moe_aux_loss", "moe_load_max", "moe_load_min"):
            assert x[key] == pytest.approx(y[key], rel=RTOL), (key, x["step"])
    cfg = pp_config("", arch="qwen3_moe").model
    cfg.vocab_size = 256
    model = build_model(cfg.resolve(), "cpu").train()
    torch.manual_seed(0)
    model(torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32)))
    pooled = float(moe_losses(model.moe)[0])
    per_stage = float(moe_losses(model.moe[:1])[0] + moe_losses(model.moe[1:])[0])  # each stage's blocks alone
    assert abs(pooled - per_stage) > 0.5 * pooled


@pytest.fixture(scope="module")
def pp3d_launched(tmp_path_factory, source, kiln_cache):
    out = tmp_path_factory.mktemp("pp3d")
    seconds = torchrun("pp3d_worker.py", out, source, nproc=8)
    (out / "launch_seconds.txt").write_text(f"{seconds:.1f}")
    return out


@pytest.mark.parametrize("strategy, arch", [("fsdp", "gpt2"), ("ddp", "llama")])
def test_tp2_pp2_dp2_trains_as_one_process(pp3d_launched, single, strategy, arch):
    """All three at once on 8 ranks: tensor parallel inside each stage, two pipeline stages, two data-parallel copies
    of each (GPT-2 with sequence parallelism and its tied embedding under FSDP2, Llama under ddp, which is FSDP2's
    replicate for DTensor parameters). The same curve, weights and val_loss as one process; each copy holds its
    stage's tp shards (ddp) or half of them (fsdp)."""
    run = pp3d_launched / f"tp2pp2dp2_{strategy}_{arch}"
    assert_same_curve(run, single / arch)
    assert_same_weights(run, single / arch)
    got, want = records(run, "eval")[-1]["val_loss"], records(single / arch, "eval")[-1]["val_loss"]
    assert got == pytest.approx(want, rel=RTOL)
    (event,) = [e for e in records(run, "event") if e["event"] == "layout"]
    assert event["mesh"] == {"pp": 2, "dp": 2, "tp": 2} and event["sequence_parallel"] == (arch == "gpt2")
    (first, last), whole = stage_bytes(arch, tp=2)
    held = event["param_bytes_per_rank"]  # rank = 4·pp + 2·dp + tp
    if strategy == "ddp":
        assert held == [first] * 4 + [last] * 4
    else:  # each tp shard's rows split between the two copies
        assert [held[0] + held[2], held[1] + held[3], held[4] + held[6], held[5] + held[7]] == [first, first, last, last]
        assert max(held[:4]) < first and max(held[4:]) < last
    assert event["param_bytes_unsharded"] == whole


def test_every_tp2_pp2_rank_judges_the_logged_loss(pp_launched):
    """The spike guard on each of the 4 ranks saw the global loss (summed over pp and dp, not tp): tp rank 1 as
    well as tp rank 0, the first stage as well as the last."""
    logged = [r["loss"] for r in records(pp_launched / "tp2pp2_gpt2", "train")]
    for rank in range(4):
        judged = json.loads((pp_launched / f"judged_rank{rank}.json").read_text())
        assert judged == pytest.approx(logged, rel=1e-6), rank  # the guard records float32


def test_a_tp2_pp2_checkpoint_resumes_on_one_process(pp_launched, single, source, tmp_path):
    """tp2 × pp2 (GPT-2, saved at step 3) → one process (to 6): DCP by full names, the fused rows in the model's
    order on disk."""
    run = continue_on_one_process(pp_launched / "tp2pp2_gpt2", tmp_path / "tp2pp2_to_one", source)
    assert_same_curve(run, single / "gpt2")
    assert_same_weights(run, single / "gpt2")


def test_bad_layouts_are_one_line_errors():
    model = ModelConfig(preset="tiny", n_layer=2, n_head=2, d_model=64, max_seq_len=64, vocab_size=256).resolve()
    cases = [
        (ParallelConfig(pp=3), 3, {}, "splits 2 blocks into 3 stages: use at most 2"),
        (ParallelConfig(pp=2, pp_schedule="interleaved_1f1b"), 2, {}, r"4 stages \(interleaved_1f1b: 2 per rank\)"),
        (ParallelConfig(pp=2, pp_microbatches=3), 2, {"batch_sequences": 4}, "must divide each rank's batch of 4"),
        (ParallelConfig(pp=2, pp_microbatches=1), 2, {"batch_sequences": 4}, "needs at least 2 pipeline micro"),
        (ParallelConfig(pp=2), 3, {}, "3 processes do not divide into"),
        (ParallelConfig(pp=2, pp_schedule="zb"), 2, {}, "pp_schedule='zb' is unknown"),
        (ParallelConfig(pp=2, strategy="zero1"), 4, {}, "parallel.pp with parallel.strategy=zero1 is not built"),
    ]
    for cfg, world, kw, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            ParallelPlan.build(cfg, world, model, **kw)
        assert "\n" not in str(e.value)
