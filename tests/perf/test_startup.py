"""Start-up: what a one-process run does not use is not imported (torch.distributed.checkpoint cost ~1.9 s of a
`kiln train` start on a 2-core CPU; benchmarks/vs_plain_loop.py measures the whole process). Nor is DTensor, with the
sympy it pulls in (~1 s of CPU for every `kiln` command on the 2-core Xeon with AMX, 2026-11-27): tensor, expert and
user-plan parallelism import it when a layout needs them, and kiln.util.is_dtensor asks without importing it."""
import subprocess
import sys

import torch

from kiln.util import is_dtensor

HEAVY = ("torch.distributed.checkpoint", "torch._dynamo", "torch._inductor", "torch.distributed.tensor", "sympy")


def test_the_cli_and_the_lm_job_import_no_distributed_checkpoint_dtensor_or_compiler():
    code = ("import sys; import kiln.cli.main as m; m.build_parser(); import kiln.run.lm, kiln.run.profile; "
            f"print([k for k in {HEAVY!r} if k in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_is_dtensor_on_plain_values():
    assert not is_dtensor(torch.zeros(2)) and not is_dtensor(None) and not is_dtensor(3.0)


def test_is_dtensor_knows_a_dtensor():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        owned = True
    else:
        owned = False
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = DTensor.from_local(torch.ones(3), mesh, [Replicate()])
        assert is_dtensor(d) and not is_dtensor(d.to_local())
    finally:
        if owned:
            dist.destroy_process_group()
