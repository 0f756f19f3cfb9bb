"""Where did the NaN come from? Replay one step with hooks on every module, gradient and op.

Three observers run during the replay, and the report combines them:
  - module hooks: the first module whose output is non-finite although its inputs are finite (forward), or
    whose input gradient is non-finite although its output gradient is finite (backward);
  - parameter-gradient hooks: the first parameter whose gradient arrives non-finite;
  - an op watcher (a TorchDispatchMode): the first aten op that turns finite inputs into a non-finite output,
    and the innermost module running at the time. Allocation ops (aten.empty and kin) are never the origin:
    their memory is uninitialized (NaN-filled under torch.use_deterministic_algorithms) until something writes
    it. A kernel that writes outside the dispatcher (Triton, also under its interpreter) shows up as the buffer
    an allocation op made turning up non-finite in the next op: the origin is that kernel, in the module that
    allocated its output.
Parameters and buffers (e.g. the rotary cos/sin cache) that already hold NaN/Inf before the replay are listed:
no op of the step made them so.
The replay runs only after a non-finite step was seen at a sync point, so its cost (a host sync per op) is paid
once per incident, never in normal steps.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kiln.numerics.stats import is_finite, json_safe, local, tensor_stats

REPORT_FILE = "nonfinite_report.json"
ROOT = "(model)"  # name reported for the top-level module, whose qualified name is ""


def _floats(obj) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


# Ops that hand out memory without computing its contents: their output is whatever the memory held.
ALLOCATION_OPS = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                            "new_empty_strided", "resize_", "resize_as_"})


def _storage(t: torch.Tensor) -> int:
    return local(t).untyped_storage().data_ptr()


class _OpWatch(TorchDispatchMode):
    def __init__(self, tracer: "NonFiniteTracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tr = self.tracer
        if tr.busy:
            return out
        if func.overloadpacket.__name__ in ALLOCATION_OPS:
            for t in _floats(out):  # remembered, never judged: uninitialized memory is no finding
                tr.allocated[_storage(t)] = (str(func), tr.current_module(), tr.phase)
            return out
        if tr.op is None or not (tr.op["inputs_finite"] or tr.op.get("outside_dispatch")):
            outs = _floats(out)
            if not all(is_finite(t) for t in outs):
                # An out= tensor is written, not read: its old contents (often uninitialized) are no input.
                ins = _floats((args, {k: v for k, v in kwargs.items() if k != "out"}))
                clean = all(is_finite(t) for t in ins)
                filled = next((tr.allocated[_storage(t)] for t in ins
                               if not is_finite(t) and _storage(t) in tr.allocated), None)
                if not clean and filled is not None:
                    # A non-finite input in memory an allocation op handed out, and no aten op wrote it non-finite
                    # (that op would have been found first): a kernel outside the dispatcher filled it so.
                    alloc, module, phase = filled
                    tr.op = {"op": f"a kernel outside aten (Triton?) that filled the output of {alloc}",
                             "module": module, "phase": phase, "inputs_finite": False, "outside_dispatch": True,
                             "inputs": [], "outputs": [tensor_stats(t) for t in ins if not is_finite(t)][:1]}
                    return out
                # Prefer the first op that turns finite inputs into non-finite outputs; keep the first
                # non-finite op of any kind until one is seen (a weight already Inf has no such op).
                if tr.op is None or clean:
                    tr.op = {
                        "op": str(func), "module": tr.current_module(), "phase": tr.phase, "inputs_finite": clean,
                        "inputs": [tensor_stats(t) for t in ins], "outputs": [tensor_stats(t) for t in outs],
                    }
        return out


class NonFiniteTracer:
    """Context manager: hooks every module and parameter of `model`, watches every op, removes it all on exit."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = {m: (n or ROOT) for n, m in model.named_modules()}
        self.phase = "forward"
        self.busy = False  # set while a hook computes statistics, so the op watcher ignores those ops
        self.module = None  # first module-level finding
        self.param = None  # first non-finite parameter gradient
        self.op = None  # first op-level finding
        self._stack: list[str] = []
        self._seq = 0
        self._grad_out_finite: dict[str, bool] = {}
        self._handles = []
        self._mode = None
        self.allocated: dict[int, tuple[str, str, str]] = {}  # storage -> (allocation op, module, phase)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def current_module(self) -> str:
        return self._stack[-1] if self._stack else ROOT

    def found(self) -> bool:
        return self.module is not None or self.param is not None or self.op is not None

    def found_anywhere(self, agree=None) -> bool:
        """found(), or on any rank: agree(found) is a collective, which the op watcher does not judge."""
        if agree is None:
            return self.found()
        self.busy = True
        try:
            return agree(self.found())
        finally:
            self.busy = False

    # -- hooks ------------------------------------------------------------------------------------------

    def _push(self, name):
        self._stack.append(name)

    def _pop(self, name):
        # Pop through `name`: a module whose backward-exit hook never fires (no input needs a gradient) is
        # popped by its parent.
        while self._stack:
            if self._stack.pop() == name:
                break

    def _forward_exit(self, name):
        def hook(module, args, kwargs, output):
            self._pop(name)
            if self.module is None:
                self.busy = True
                ins, outs = _floats((args, kwargs)), _floats(output)
                if all(is_finite(t) for t in ins) and not all(is_finite(t) for t in outs):
                    self.module = {"seq": self._next(), "module": name, "phase": "forward",
                                   "inputs": [tensor_stats(t) for t in ins], "outputs": [tensor_stats(t) for t in outs]}
                self.busy = False
        return hook

    def _backward_enter(self, name):
        def hook(module, grad_output):
            self._push(name)
            self.busy = True
            self._grad_out_finite[name] = all(is_finite(t) for t in _floats(grad_output))
            self.busy = False
        return hook

    def _backward_exit(self, name):
        def hook(module, grad_input, grad_output):
            if self.module is None:
                self.busy = True
                gin, gout = _floats(grad_input), _floats(grad_output)
                if all(is_finite(t) for t in gout) and not all(is_finite(t) for t in gin):
                    # "inputs" of a module's backward are the gradients arriving at its output, and vice versa.
                    self.module = {"seq": self._next(), "module": name, "phase": "backward",
                                   "inputs": [tensor_stats(t) for t in gout],
                                   "outputs": [tensor_stats(t) for t in gin]}
                self.busy = False
            self._pop(name)
        return hook

    def _param_grad(self, pname, owner):
        def hook(grad):
            if self.param is None:
                self.busy = True
                if not is_finite(grad) and self._grad_out_finite.get(owner, True):
                    self.param = {"seq": self._next(), "module": owner, "parameter": pname, "phase": "backward",
                                  "outputs": [tensor_stats(grad)]}
                self.busy = False
        return hook

    def __enter__(self):
        for module, name in self.names.items():
            self._handles += [
                module.register_forward_pre_hook(lambda m, a, name=name: self._push(name)),
                module.register_forward_hook(self._forward_exit(name), with_kwargs=True),
                module.register_full_backward_pre_hook(self._backward_enter(name)),
                module.register_full_backward_hook(self._backward_exit(name)),
            ]
        seen = set()
        for pname, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                owner = pname.rpartition(".")[0] or ROOT
                self._handles.append(p.register_hook(self._param_grad(pname, owner)))
        self._mode = _OpWatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- result ------------------------------------------------------------------------------------------

    def finding(self) -> dict:
        """The origin: module-level finding first (forward before backward), then parameter, then op alone."""
        candidates = [f for f in (self.module, self.param) if f is not None]
        where = min(candidates, key=lambda f: f["seq"]) if candidates else None
        op = self.op
        if where is None and op is None:
            return {"module": None, "op": None, "phase": None, "reproduced": False}
        if where is None:
            where = {"module": op["module"], "phase": op["phase"]}
        same_phase = op is not None and op["phase"] == where["phase"]
        out = {"module": where["module"], "phase": where["phase"], "reproduced": True,
               "op": op["op"] if same_phase else None,
               "op_module": op["module"] if same_phase else None,
               "stats": ({"inputs": op["inputs"], "outputs": op["outputs"], "inputs_finite": op["inputs_finite"]}
                         if same_phase else {"inputs": where.get("inputs", []), "outputs": where["outputs"]}),
               **({"outside_dispatch": True} if same_phase and op.get("outside_dispatch") else {}),
               "module_stats": {"inputs": where.get("inputs", []), "outputs": where.get("outputs", [])}}
        if "parameter" in where:
            out["parameter"] = where["parameter"]
        return out


def replay_step(model: nn.Module, batches, losses, scaler, agree=None) -> tuple[dict, int]:
    """Forward and backward of each micro-batch under the tracer until something non-finite shows up.

    agree(found) -> whether any rank found something: for a model whose forward and backward are collectives (FSDP2,
    tensor parallelism), every rank replays in lockstep and all stop at the same phase (a rank that stopped alone
    would leave the others waiting in the next collective). None: each rank (or one process) decides alone.

    `losses(model, batches)` yields (normalised loss, count) per micro-batch exactly as the training step makes
    them (kiln.train.step.micro_batch_losses): the forward of a micro-batch runs when its loss is drawn.
    Returns (finding, micro-batch index). The RNG streams and gradients are left as they were found, so a
    replay never changes what training does next.
    """
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    saved_grads = {p: p.grad for p in model.parameters()}
    index = 0
    try:
        # Modules fed only token ids (the embeddings, the model itself) make torch warn that their backward hook
        # fires on output gradients: expected here, and said once per replay would only be noise.
        with warnings.catch_warnings(), NonFiniteTracer(model) as tracer:
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            drawn = iter(losses(model, batches))
            for index in range(len(batches)):
                model.zero_grad(set_to_none=True)
                tracer.phase = "forward"
                loss, _ = next(drawn)
                if tracer.found_anywhere(agree):
                    break
                tracer.phase = "backward"
                scaler.scale_loss(loss).backward()
                if tracer.found_anywhere(agree):
                    break
        return tracer.finding(), index
    finally:
        for p, g in saved_grads.items():
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def nonfinite_params(model: nn.Module) -> list[str]:
    """Parameters that already hold NaN/Inf: then every forward is poisoned, whatever the data."""
    return [n for n, p in model.named_parameters() if not is_finite(p.detach())]


def nonfinite_buffers(model: nn.Module) -> list[str]:
    """Floating-point buffers (e.g. the rotary cos/sin cache) that already hold NaN/Inf before the step."""
    return [n for n, b in model.named_buffers() if b.is_floating_point() and not is_finite(b)]


def trace_nonfinite(model, batches, losses, scaler, step: int, observed: dict, run_dir: Path | None,
                    agree=None) -> dict:
    """Replay step `step` and write nonfinite_report.json in run_dir (None: do not write); returns the report.
    agree: replay_step's."""
    bad_params, bad_buffers = nonfinite_params(model), nonfinite_buffers(model)
    finding, micro_batch = replay_step(model, batches, losses, scaler, agree)
    report = {"module": finding.pop("module"), "op": finding.pop("op"), "phase": finding.pop("phase"),
              "step": step, "stats": finding.pop("stats", {}), "micro_batch": micro_batch,
              "observed": observed, "nonfinite_parameters": bad_params, "nonfinite_buffers": bad_buffers, **finding}
    if bad_buffers and not report["stats"].get("inputs_finite", True):
        # No op of the step made the NaN: a buffer computed before it (when the model was built) already held it.
        name = bad_buffers[0]
        report |= {"module": name.rpartition(".")[0] or ROOT, "buffer": name, "phase": "before the step"}
    report = json_safe(report)
    if run_dir is not None:
        write_report(report, run_dir)
    return report


def write_report(report: dict, run_dir: Path) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")


def describe(report: dict) -> str:
    """Two or three lines for the console."""
    step = report["step"]
    if not report.get("reproduced"):
        return (f"non-finite at step {step} (loss {report['observed'].get('loss')}, grad_norm "
                f"{report['observed'].get('grad_norm')}); the replay with hooks stayed finite, so the origin is "
                f"unknown (the weights moved since, or the NaN came from nondeterminism)")
    line = f"non-finite at step {step}: first in {report['phase']} of {report['module']}"
    if report.get("buffer"):
        line = f"non-finite at step {step}: buffer {report['buffer']} held NaN/Inf before the step"
    if "rank" in report:
        line += f" on rank {report['rank']}"
    if report.get("op"):
        line += f", op {report['op']}"
        if report.get("op_module") not in (None, report["module"]):
            line += f" (inside {report['op_module']})"
    if report.get("parameter"):
        line += f", gradient of {report['parameter']}"
    outs = report["stats"].get("outputs") or [{}]
    ins = report["stats"].get("inputs") or []
    line += (f"\n  output: {outs[0].get('nonfinite')} non-finite of {outs[0].get('numel')}, finite absmax "
             f"{outs[0].get('absmax')}; inputs absmax {[i.get('absmax') for i in ins][:4]}, non-finite "
             f"{[i.get('nonfinite') for i in ins][:4]}")
    if report.get("nonfinite_parameters"):
        line += f"\n  parameters already non-finite: {', '.join(report['nonfinite_parameters'][:8])}"
    if report.get("nonfinite_buffers"):
        line += (f"\n  buffers already non-finite: {', '.join(report['nonfinite_buffers'][:8])} (computed before the "
                 f"step, when the model was built: check the config values they come from, e.g. model.rope_theta)")
    return line
