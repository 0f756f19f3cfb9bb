"""No host-device sync inside a training step, for every optimizer, implementation, offload mode and precision.

A host sync (`.item()`, `bool(t)`, `.cpu()` ...) makes the host wait until the device has finished everything
queued so far, so the next step's work cannot be queued behind it: 10-30% of step time on a GPU. On CUDA the
driver-level check is torch.cuda.set_sync_debug_mode("error"); on CPU, where nothing waits, a TorchFunctionMode
counts every call that would be a sync on a device, so the same code is checked without a GPU.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kiln.config import load_config
from kiln.train.host_optimizer import HostOptimizer
from kiln.numerics.monitor import Handles, Numerics
from kiln.run.lm import build_lm
from kiln.train.step import train_step
from tests.conftest import requires_cuda

# Calls that make the host wait for the device: reading a value back, or an output whose shape depends on values.
SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero,
    torch.nonzero, torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique, torch.equal,
    torch.allclose, torch.Tensor.allclose, torch.is_nonzero, torch.Tensor.is_nonzero,
}


def _is_sync(func, args, kwargs) -> bool:
    if func in SYNCING:
        return True
    if func is torch.where and len(args) + len(kwargs) == 1:  # torch.where(cond) is nonzero
        return True
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):  # boolean-mask indexing
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.ndim > 0 for i in index)
    if func is torch.Tensor.to:  # device to host
        target = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return args[0].device.type != "cpu" and any(torch.device(t).type == "cpu" for t in target)
    return False


class HostSyncCounter(TorchFunctionMode):
    """Records, by name, every call made under it that would synchronize a device with the host."""

    def __init__(self, calls: list | None = None):
        super().__init__()
        self.calls = [] if calls is None else calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core machine two threads per process spin against other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def host_thread_calls(monkeypatch):
    """host-async runs the host update on its own thread, where a TorchFunctionMode of the caller does not reach
    (modes are per thread): count there too."""
    calls = []
    update = HostOptimizer._host_update

    def counted(self, wait_for):
        with HostSyncCounter(calls):
            update(self, wait_for)

    monkeypatch.setattr(HostOptimizer, "_host_update", counted)
    return calls


OPTIMIZERS = [(name, impl) for name in ("adamw", "adam", "sgd") for impl in ("fused", "foreach", "loop")]
OPTIMIZERS.append(("adamw8bit", "auto"))  # kiln's own; fused/foreach do not apply
OFFLOADS = ("none", "host", "host-async")
PRECISIONS = ("fp32", "bf16", "bf16-master", "fp16")  # fp16 autocast and loss scaling run on CPU too


def _rig(name, impl, offload, precision, device, *extra):
    cfg = load_config(None, ["--model.n_layer=1", "--model.d_model=64", "--model.n_head=2", "--data.seq_len=32",
                             "--train.micro_batch_size=2", f"--train.device={device}", f"--precision.mode={precision}",
                             f"--optim.name={name}", f"--optim.implementation={impl}", f"--optim.offload={offload}",
                             *extra])
    return cfg, build_lm(cfg, device=torch.device(device), with_data=False).state


def _guard(cfg, rig, device):
    """The step guard as `kiln train` builds it (Numerics), withholding spikes, judging from the second step."""
    handles = Handles(model=rig.model, losses=None, scaler=rig.scaler, masters=rig.masters,
                      device=torch.device(device), step=lambda: 0, loader_position=lambda: 0,
                      skip_batches=lambda n: None, snapshot=rig.state_dict, restore=rig.load_state_dict,
                      load_checkpoint=lambda: None)
    return Numerics(cfg.numerics, cfg.faults, handles, run_dir=".", log_interval=10)


def _three_steps(cfg, rig, device, counter_calls, numerics=None, sync_debug=False):
    """Steps 1 (state made), 2 (an inf gradient: withheld) and 3, each run under the counter; returns skipped."""
    torch.manual_seed(0)
    x = torch.randint(0, rig.model.cfg.vocab_size, (2, cfg.data.seq_len + 1), device=device)
    batches = [(x[:, :-1], x[:, 1:])]
    norm = dict(rig.model.named_parameters())["norm.weight"]
    results = []
    for step in (1, 2, 3):
        handle = norm.register_hook(lambda g: g * float("inf")) if step == 2 else None
        if sync_debug:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with HostSyncCounter(counter_calls):
                guard = None
                if numerics is not None:
                    batches = numerics.begin_step(step, batches)
                    guard = numerics.guard
                results.append(train_step(rig.step_model, batches, rig.objective, rig.optimizer, rig.precision,
                                          rig.scaler, cfg.optim, rig.masters, guard,
                                          adaptive_clip=rig.adaptive_clip))
        finally:
            if sync_debug:
                torch.cuda.set_sync_debug_mode("default")
            if handle is not None:
                handle.remove()
    if isinstance(rig.optimizer, HostOptimizer):
        rig.optimizer.flush()  # joins the host thread: its calls are all counted by now
    return torch.stack([r.skipped for r in results]).tolist()


# ---------------------------------------------------------------- the counter can fail


@pytest.mark.parametrize("call", [
    lambda t: t.item(), lambda t: t.tolist(), lambda t: bool(t), lambda t: 1 if t else 0, lambda t: int(t),
    lambda t: float(t), lambda t: [0, 1, 2][t.long()], lambda t: t.cpu(), lambda t: t.numpy(),
    lambda t: torch.arange(3)[torch.arange(3) > t], lambda t: torch.where(t > 0), lambda t: torch.equal(t, t),
], ids=["item", "tolist", "bool", "if", "int", "float", "index", "cpu", "numpy", "bool-mask", "where1", "equal"])
def test_counter_sees_each_kind_of_sync(call):
    t = torch.tensor(1.0)
    with HostSyncCounter() as counter:
        call(t)
    assert len(counter.calls) >= 1


def test_counter_sees_a_sync_inside_train_step():
    """torch's own foreach AdamW, which kiln no longer builds: optimizer_step's fallback reads the flag with
    `.item()` each step, and torch reads its host-side step counts too. Counted."""
    cfg, rig = _rig("adamw", "foreach", "none", "fp32", "cpu")
    params = [p for p in rig.model.parameters() if p.requires_grad]
    rig.optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    calls = []
    assert _three_steps(cfg, rig, "cpu", calls) == [0.0, 1.0, 0.0]
    assert set(calls) == {"item"} and len(calls) >= 3


def test_counter_sees_the_host_thread(host_thread_calls):
    cfg, rig = _rig("adamw", "fused", "host-async", "fp32", "cpu")
    real_step = rig.optimizer.inner.step

    def step_that_syncs(*args, **kwargs):
        rig.optimizer.inner.found_inf.item()
        return real_step(*args, **kwargs)

    rig.optimizer.inner.step = step_that_syncs
    calls = []
    _three_steps(cfg, rig, "cpu", calls)
    assert calls == [] and host_thread_calls == ["item"] * 3


# ---------------------------------------------------------------- every combination: zero


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("name,impl", OPTIMIZERS)
def test_no_host_sync_in_train_step_cpu(name, impl, offload, precision, host_thread_calls):
    cfg, rig = _rig(name, impl, offload, precision, "cpu")
    calls = []
    assert _three_steps(cfg, rig, "cpu", calls) == [0.0, 1.0, 0.0]  # the withheld path ran too
    assert calls == [] and host_thread_calls == []


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name,impl,offload", [("adamw", "fused", "none"), ("sgd", "loop", "none"),
                                               ("adam", "foreach", "host-async"), ("adamw8bit", "auto", "host")])
def test_no_host_sync_with_the_numerics_guard_cpu(name, impl, offload, precision, host_thread_calls):
    """The step guard of a real run (spike judgement, withhold, fp16 telemetry on its first step) adds none."""
    cfg, rig = _rig(name, impl, offload, precision, "cpu", "--numerics.spike_policy=skip", "--numerics.trace=false",
                    "--numerics.spike_window=3", "--numerics.spike_min_history=1",
                    "--numerics.fp16_telemetry_interval=1")
    numerics = _guard(cfg, rig, "cpu")
    assert numerics.guard is not None and numerics.guard.withhold
    calls = []
    assert _three_steps(cfg, rig, "cpu", calls, numerics) == [0.0, 1.0, 0.0]
    assert calls == [] and host_thread_calls == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_no_host_sync_with_adaptive_clipping(device, precision, host_thread_calls):
    """AutoClip's percentile of the norm history is taken on the device; a withheld (inf) step leaves it alone."""
    cfg, rig = _rig("adamw", "auto", "none", precision, device, "--optim.clip_mode=adaptive")
    assert rig.adaptive_clip is not None
    calls = []
    assert _three_steps(cfg, rig, device, calls, sync_debug=device == "cuda") == [0.0, 1.0, 0.0]
    assert calls == [] and host_thread_calls == [] and int(rig.adaptive_clip.seen) == 2


@requires_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("name,impl", OPTIMIZERS)
@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "guard"])
def test_no_host_sync_in_train_step_cuda(name, impl, offload, precision, guarded, host_thread_calls):
    """The driver's own check: any synchronizing CUDA call inside the step raises. (mode "host" still waits on a
    CUDA event for the gradients it updates on the host — its design; event waits are not flagged.)"""
    extra = ["--numerics.spike_policy=skip", "--numerics.spike_window=3", "--numerics.spike_min_history=1",
             "--numerics.fp16_telemetry_interval=1", "--numerics.trace=false"] if guarded else []
    cfg, rig = _rig(name, impl, offload, precision, "cuda", *extra)
    numerics = _guard(cfg, rig, "cuda") if guarded else None
    calls = []
    assert _three_steps(cfg, rig, "cuda", calls, numerics, sync_debug=True) == [0.0, 1.0, 0.0]
    assert calls == [] and host_thread_calls == []


@pytest.mark.parametrize("precision", PRECISIONS)
def test_muon_reads_the_skip_flag_once_per_step(precision, host_thread_calls):
    """optim.name=muon: torch's Muon takes no found_inf, so kiln.train.muon reads the flag on the host, one `.item()`
    per step (its documented choice over keeping a copy of the matrices and momenta to restore); nothing else."""
    cfg, rig = _rig("muon", "auto", "none", precision, "cpu")
    calls = []
    assert _three_steps(cfg, rig, "cpu", calls) == [0.0, 1.0, 0.0]
    assert calls == ["item"] * 3 and host_thread_calls == []


# ---------------------------------------------------------------- a mixture of experts: routing and experts


@pytest.mark.parametrize("precision", ("fp32", "bf16", "bf16-master"))
def test_no_host_sync_in_a_mixture_of_experts_step_cpu(precision):
    """Qwen3-MoE's routing counts on the device and its experts in grouped_mm (kiln.models.moe): none. The loop
    over experts, the fallback where grouped_mm does not run, reads its split sizes back: one per block, seen."""
    cfg, rig = _rig("adamw", "fused", "none", precision, "cpu", "--model.preset=qwen3-moe-nano")
    layers = rig.model.moe
    assert len(layers) == 1
    calls = []
    assert _three_steps(cfg, rig, "cpu", calls) == [0.0, 1.0, 0.0]
    assert calls == []
    layers[0].grouped = False
    _three_steps(cfg, rig, "cpu", calls)
    assert calls == ["tolist"] * 3
