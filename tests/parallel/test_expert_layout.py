"""Expert parallelism's layout in one process: the bad layouts word for word, the same line from `kiln train`,
`kiln memory` and `kiln plan` (they share kiln.parallel.layout's checks), and the ep ranks and mesh record against
a layout written out by hand. The ep runs themselves: tests/parallel/test_expert_parallel.py."""
import pytest

from kiln.cli.main import main
from kiln.models import ModelConfig
from kiln.models.registry import family
from kiln.parallel import ParallelConfig
from kiln.parallel.layout import ParallelPlan

NANO = "--model.preset=qwen3-moe-nano"
BAD = [
    # a dense family: there are no experts to split
    ("--model.preset=tiny", 2, ["--parallel.ep=2"],
     "parallel.ep=2 splits the experts of a mixture of experts, but model.arch=gpt2 is dense (one MLP per block): "
     "use --parallel.ep=1 or a mixture-of-experts model (--model.preset=qwen3-moe-nano)"),
    # 8 experts do not split into 3 whole shares
    (NANO, 3, ["--parallel.ep=3"],
     "parallel.ep=3 does not divide model.n_experts = 8: pick an ep that divides it (each ep rank holds "
     "n_experts/ep whole experts)"),
    # ep is carved out of dp = world / (tp·pp·cp): 4 processes with tp2 leave 2 data-parallel ranks
    (NANO, 4, ["--parallel.ep=4", "--parallel.tp=2"],
     "parallel.ep=4 does not divide the 2 data-parallel ranks (4 processes / (tp=2 × pp=1 × cp=1)): expert "
     "parallelism is carved out of them; pick an ep that divides 2 or launch 4× more processes"),
]


@pytest.mark.parametrize("model,world,flags,line", BAD, ids=["dense", "n_experts", "dp"])
def test_a_bad_layout_is_the_same_line_from_memory_and_plan(capsys, model, world, flags, line):
    for argv in (["memory", "--out=", model, f"--ranks={world}", "--parallel.strategy=fsdp", *flags],
                 ["plan", model, f"--gpus={world}", *flags]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"kiln {argv[0]}: error: {line}\n", argv


def test_a_bad_layout_is_the_same_line_from_train(capsys, tmp_path):
    """`kiln train` in one process refuses before a step: a dense family and n_experts through ParallelPlan.build,
    the launch's dp through the same check (here 1 process: dp = 1)."""
    source = tmp_path / "corpus.txt"
    source.write_text("def f(x):\n    return x\n" * 200)
    common = [f"--data.source={source}", "--train.max_steps=1", "--train.device=cpu", f"--run-dir={tmp_path}/run"]
    for model, _, flags, line in BAD[:2]:
        assert main(["train", model, *flags, *common]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"kiln train: error: {line}"
    assert main(["train", NANO, "--parallel.ep=2", *common]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kiln train: error: parallel.ep=2 does not divide the 1 data-parallel ranks (1 process / (tp=1 × pp=1 × "
        "cp=1)): expert parallelism is carved out of them; pick an ep that divides 1 or launch 2× more processes")


def test_the_ep_ranks_are_neighbours_along_dp():
    """8 ranks as tp2 × dp4 with ep2: rank = dp·2 + tp, the dp index = dp_mod_ep·2 + ep index; an ep group is 2
    neighbouring dp copies of the same tp shard, and ep is recorded beside dp, not multiplied into the world."""
    model = ModelConfig(preset="qwen3-moe-nano").resolve()
    plan = ParallelPlan.build(ParallelConfig(tp=2, ep=2, strategy="fsdp"), 8, model, family(model.arch))
    assert (plan.dp, plan.ep) == (4, 2)
    assert plan.mesh_record == {"pp": 1, "dp": 4, "tp": 2, "ep": 2}
    assert [plan.ep_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [plan.ep_ranks(r) for r in (0, 1, 2, 5, 6)] == [[0, 2], [1, 3], [0, 2], [5, 7], [4, 6]]
    assert plan.holds(6, n_layer=2)["ep_shard"] == 1
