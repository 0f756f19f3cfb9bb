"""LoRA under FSDP2 on 2 gloo ranks (tests/parallel/worker.py's launch) against one process: the frozen base and
the adapters are both sharded, the base stored in bf16 under precision.mode=bf16, and the run is the same run."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.parallel.test_dist import losses, records

RTOL = {"fp32": 1e-6, "bf16": 2e-3}  # fp32: test_dist.py's tolerance (the same sums in another order); bf16: the
#                                    reduce-scatter rounds each rank's gradient share to bf16 before summing


def _weights(run_dir):
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_two_rank_fsdp_lora_run_equals_one_process(launched, lora_reference, mode):
    got, want = losses(launched / f"lora_fsdp_{mode}"), losses(lora_reference / mode)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=RTOL[mode]), step
    ev_got, ev_want = records(launched / f"lora_fsdp_{mode}", "eval"), records(lora_reference / mode, "eval")
    assert ev_got[-1]["val_loss"] == pytest.approx(ev_want[-1]["val_loss"], rel=RTOL[mode])
    a, b = _weights(launched / f"lora_fsdp_{mode}"), _weights(lora_reference / mode)
    assert a.keys() == b.keys()
    adapters = [k for k in a if ".lora_" in k]
    assert len(adapters) == 2 * 4 * 2  # A and B of 4 linears in 2 blocks (GPT-2: one piece each)
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), rtol=RTOL[mode], atol=1e-6, msg=key)
    assert any(float(a[k].abs().max()) > 0 for k in adapters if ".lora_B." in k)  # the adapters trained
    held = json.loads((launched / f"lora_fsdp_{mode}.json").read_text())
    base = {n: v for n, v in held["params"].items() if ".lora_" not in n}
    lora = {n: v for n, v in held["params"].items() if ".lora_" in n}
    frozen = "torch.bfloat16" if mode == "bf16" else "torch.float32"
    assert all(v[0] == frozen and not v[2] for v in base.values())  # the base: 2 B each under bf16, frozen
    assert all(v[0] == "torch.float32" and v[2] for v in lora.values())  # the adapters: fp32, trained
    assert all(v[1] == "DTensor" and v[3] < v[4] for v in held["params"].values() if v[4] >= 4)  # all sharded
    assert held["optimized"] == sum(v[4] for v in lora.values()) == 8192  # the optimizer holds the adapters only
