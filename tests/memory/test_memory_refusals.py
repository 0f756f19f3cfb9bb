"""kiln.memory's refusals that only a library caller reaches (kiln's runs check the config sections first; the
`kiln` command's rows are in tests/cli/test_error_sites.py): each is a KilnError naming its key, the value given
and the fix, and still a ValueError for callers that catch one."""
import pytest

from kiln.config import load_config
from kiln.errors import KilnError
from kiln.memory.chunked_loss import ChunkedLMLoss
from kiln.memory.devices import get_device
from kiln.memory.estimate import optimizer_state_bytes, parse_bytes, recompute_plan
from kiln.memory.levers import JobSections, job_for
from kiln.memory.offload import apply_offload
from kiln.memory.planner import fit_time_model
from kiln.memory.recompute import apply_recompute
from kiln.models import build_model

from tests.memory.conftest import MODELS


def refused(call, key, value, *fragments) -> KilnError:
    with pytest.raises(KilnError) as info:
        call()
    e = info.value
    assert isinstance(e, ValueError) and e.key == key and e.value == value and e.fix, (e.key, e.value, e.fix)
    for fragment in fragments:
        assert fragment in str(e), str(e)
    return e


def test_estimator_refusals_name_the_key():
    refused(lambda: parse_bytes("6 GiBs", "memory.recompute_budget"), "memory.recompute_budget", "6 GiBs",
            "memory.recompute_budget='6 GiBs'", "24GiB")
    assert refused(lambda: parse_bytes("lots"), None, "lots", "cannot read 'lots' as a size").key is None
    refused(lambda: recompute_plan("every_k", 4, 0), "memory.recompute_every", 0, "≥ 1")
    refused(lambda: recompute_plan("budget", 4), "memory.recompute", "budget", "solve_budget")
    refused(lambda: optimizer_state_bytes([10], "lion"), "optim.name", "lion", "adamw8bit")
    refused(lambda: ChunkedLMLoss(0), "memory.chunked_loss", 0, "≥ 1 tokens")


def test_a_calibration_of_one_size_is_refused():
    device = get_device("H100")  # a table entry: nothing measured
    job = job_for(JobSections.of(load_config(None, ["--model.preset=tiny", "--model.n_layer=2"])), device)
    refused(lambda: fit_time_model(device, [(job, 0.5), (job, 0.6)], 0.8), "observations", 2, "more different sizes")


def test_recompute_plans_a_model_cannot_take():
    model = build_model(MODELS["gpt2"]())  # 2 blocks
    refused(lambda: apply_recompute(model, ("full",)), "plan", ("full",), "1 entries for 2 blocks")
    refused(lambda: apply_recompute(model, ("seg", "full")), "plan", ("seg", "full"), "block 0 is 'seg'")
    refused(lambda: apply_recompute(model, ("none", "most")), "plan", ("none", "most"), "'most' is unknown")
    apply_offload(model, frozenset({0}))
    refused(lambda: apply_recompute(model, ("full", "none")), "model", None, "before activation offload")
