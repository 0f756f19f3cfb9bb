"""Tensor parallelism of a model kiln does not know, by the user's own plan: `kiln.fit(..., tensor_parallel=fn)`.

    apply_user_plan(model, tp_mesh, fn)   fn(model, tp_mesh) splits what it chooses; kiln holds the rest

torchtitan's division of labour: the user's function applies torch's `parallelize_module` (ColwiseParallel,
RowwiseParallel, SequenceParallel, ...) on the mesh's tp dim to a model that knows nothing of parallelism, and
kiln then applies everything else in its pipeline's order (recompute, FSDP2 or DDP over the dp dim, compile), as it
does after its own plan for its Transformer (kiln.parallel.tensor).

A plan rarely names every parameter (a norm, an embedding, a head that each tp rank computes whole). Those are
made replicated DTensors on the tp mesh (kiln.parallel.tensor.Held: tensor inputs taken as replicated, the output
handed on as the local tensor), so that every parameter is a DTensor on the one tp mesh, as under kiln's own plan:
FSDP2 then sees one 2-D (dp, tp) mesh, and the global gradient norm, the optimizer and DCP one kind of tensor. Each
outermost module whose parameters are all left whole is held as one. A module that holds parameters of its own
and also has split submodules cannot be held (its own arithmetic would meet both local tensors and DTensors): that
is a one-line error naming the module, as are a plan that splits nothing and one applied on another mesh.
"""
from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from kiln.errors import KilnError
from kiln.parallel.tensor import Held


def apply_user_plan(model: nn.Module, mesh, fn: Callable) -> None:
    """fn(model, mesh) splits the model over the tp `mesh` in place; every parameter it leaves whole is then
    replicated over it (module docstring)."""
    fn(model, mesh)
    split = {n: p for n, p in model.named_parameters() if isinstance(p, DTensor)}
    if not split:
        raise KilnError(f"tensor_parallel={_name(fn)} split no parameter of {type(model).__name__}: apply your "
                        f"plan with parallelize_module(model, tp_mesh, {{...}}) on the mesh it is given",
                        key="tensor_parallel", value=_name(fn),
                        fix="apply your plan with parallelize_module(model, tp_mesh, {...}) on the mesh it is given")
    other = next((n for n, p in split.items() if p.device_mesh != mesh), None)
    if other is not None:
        raise KilnError(f"tensor_parallel={_name(fn)} put {other} on a mesh of dims "
                        f"{split[other].device_mesh.mesh_dim_names}, not the tp mesh it was given: use that mesh "
                        f"(kiln lays the data-parallel dim over it)", key="tensor_parallel", value=_name(fn),
                        fix="use that mesh")
    _hold(model, mesh, "")


def _hold(module: nn.Module, mesh, name: str) -> None:
    """Replicate the parameters under `module` that the plan left whole, one outermost module at a time."""
    params = list(module.parameters())
    if not params or all(isinstance(p, DTensor) for p in params):
        return
    if not any(isinstance(p, DTensor) for p in params):
        parallelize_module(module, mesh, Held())
        return
    own = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
    if own:
        where = f"{name} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
        raise KilnError(f"{where} holds {', '.join(own)} itself and has split submodules, so kiln cannot replicate "
                        f"them: move them into a submodule of their own (kiln replicates it), or split them in your "
                        f"plan", key="tensor_parallel", value=where,
                        fix="move them into a submodule of their own (kiln replicates it), or split them in your plan")
    for child_name, child in module.named_children():
        _hold(child, mesh, f"{name}.{child_name}" if name else child_name)


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)
