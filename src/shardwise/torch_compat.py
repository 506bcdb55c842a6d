"""The fence around torch's private APIs: every private torch symbol shardwise uses is named
here once, with why it is needed, and the rest of the package imports it from here. When torch
moves one, this module is the one to change (``tests/test_architecture.py`` checks that no other
module reaches a private torch name).

Light symbols are bound at import; those of heavy torch packages (dynamo, distributed
checkpoint, fx, the module tracker) load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.distributed_c10d as _c10d
import torch.utils._pytree as pytree  # flatten/unflatten of nested args; torch has no public one
from torch._ops import OpOverload, OpOverloadPacket  # the types of aten ops and their packets
from torch.distributed._functional_collectives import (  # waited at first non-view use
    AsyncCollectiveTensor,
)
from torch.utils._python_dispatch import (
    TorchDispatchMode,  # the base of fast_call's op cache
    _disable_current_modes,
)

# run beneath a tracer's modes (the traced road's custom op)
disable_current_modes = _disable_current_modes

tree_flatten, tree_leaves, tree_map = pytree.tree_flatten, pytree.tree_leaves, pytree.tree_map

# ----- tensor subclass and dispatch machinery ---------------------------------------------------

# builds DTensor, the wrapper subclass whose data lives in its components
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
# DTensor opts out of __torch_function__ so every op reaches __torch_dispatch__
disabled_torch_function_impl = torch._C._disabled_torch_function_impl
# whether a torch-function mode is active (the fast path steps aside then)
is_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
# how many dispatch modes are on the stack: a tracer (fake tensors, proxy) is running
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack
# runs a view's local op on the raw components without re-entering DTensor's handler
DisableTorchDispatch = torch._C._DisableTorchDispatch
# the C bindings the fast path calls ops through (torch.add, Tensor.add)
VariableFunctions = torch._C._VariableFunctions
TensorBase = torch._C.TensorBase
# CompositeImplicitAutograd ops decompose themselves: op_inputs runs their decomposition
DispatchKey = torch._C.DispatchKey
dispatch_has_kernel_for_dispatch_key = torch._C._dispatch_has_kernel_for_dispatch_key
# -1 outside autograd's backward: implicit moves are allowed while backward runs
current_graph_task_id = torch._C._current_graph_task_id
# the thread-local flag torch's own kernels set where a plain tensor they make beside DTensors
# is replicated (vmap's embedding batch rule: its index step); torch's implicit_replication too
torch_allows_implicit_replication: Callable[[], bool] = getattr(
    torch._C, "_get_dtensor_allow_implicit_replication", lambda: False)
# every op schema torch knows: the _foreach_* ops are registered from it
jit_get_all_schemas = torch._C._jit_get_all_schemas
# the per-device norm of a list of tensors, one kernel (torch.linalg has no list form)
foreach_norm = torch._foreach_norm


def kernel_default_generator() -> torch.Generator:
    """The generator CPU kernels draw from when given none (``torch.random.default_generator``
    may be a rank thread's stand-in)."""
    return torch._C.default_generator


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (FSDP's reduce after the last
    gradient; torch has no public hook for the end of backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def elementwise_prims() -> list[OpOverload]:
    """torch's elementwise ``prims`` (``prims.bessel_i0e``, ``prims.erfcx``, ``prims.add``...),
    which its references and decompositions call: torch tags only a few of them pointwise, but
    every one is made with the meta function ``torch._prims._prim_elementwise_meta`` (or its
    complex-only form), which is how they are told from the prims that reshape or reduce."""
    import functools

    import torch._prims as prims

    metas = (prims._prim_elementwise_meta, prims._complex_only_elementwise_meta)
    found = []
    for name in sorted(dir(torch.ops.prims)):
        meta = getattr(getattr(torch.ops.prims, name), "prim_meta_impl", None)
        if isinstance(meta, functools.partial) and meta.func in metas:
            found.append(getattr(torch.ops.prims, name).default)
    return found


def foreach_supported_types() -> list[list[type]]:
    """torch's lists of tensor types that may take the foreach paths (``clip_grad_norm_``, the
    optimizers): DTensor appends itself."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    return [_foreach_utils._foreach_supported_types, optimizer._foreach_supported_types]


# ----- torch.distributed (c10d) ----------------------------------------------------------------

# the functional collectives' op namespace (the traced road's graph ops)
c10d_functional = torch.ops._c10d_functional
# how many functional collectives of this process are issued and not yet waited
unwaited_collectives = torch._C._distributed_c10d._get_work_registry_size
# c10d keeps its process-group maps in one ``_World``: rank threads give each thread its own
C10dWorld = _c10d._World
# the default group and the helper ``new_group`` uses: a group named by its ranks alone
get_default_group = _c10d._get_default_group
new_process_group_helper = _c10d._new_process_group_helper


def c10d_world() -> Any:
    """c10d's process-wide ``_World`` (its maps of groups, backends and ranks)."""
    return _c10d._world


def set_c10d_world(world: Any) -> None:
    """Replace c10d's ``_World`` (rank threads install a per-thread switch)."""
    _c10d._world = world


def set_thread_isolation_mode(on: bool) -> None:
    """One process-group registry per thread (rank threads register groups by the same names)."""
    torch._C._distributed_c10d._set_thread_isolation_mode(on)


def functional_resolve_group() -> Callable[..., Any]:
    """The functional collectives' group resolver (``as_torch`` wraps it to take meshes)."""
    import torch.distributed._functional_collectives as funcol

    return funcol._resolve_group


def set_functional_resolve_group(resolve: Callable[..., Any]) -> None:
    """Install ``resolve`` as the functional collectives' group resolver."""
    import torch.distributed._functional_collectives as funcol

    funcol._resolve_group = resolve


# ----- heavy packages, loaded on first use ------------------------------------------------------

_LAZY: dict[str, tuple[str, str]] = {
    # dynamo: the opaque call of tracing.dynamo_opaque and the frames it skips
    "nonstrict_trace": ("torch._dynamo", "nonstrict_trace"),
    "FrameAction": ("torch._dynamo.eval_frame", "FrameAction"),
    "FrameExecStrategy": ("torch._dynamo.eval_frame", "FrameExecStrategy"),
    "set_code_exec_strategy": ("torch._dynamo.eval_frame", "set_code_exec_strategy"),
    # whether fx is tracing (TF-style helpers refuse to run then)
    "is_fx_symbolic_tracing": ("torch.fx._symbolic_trace", "is_fx_symbolic_tracing"),
    # the module tree a forward is in (debug's per-module accounting)
    "ModTracker": ("torch.distributed._tools.mod_tracker", "ModTracker"),
    # DCP's flattening of nested state dicts and its writer back into them
    "flatten_state_dict": ("torch.distributed.checkpoint._nested_dict", "flatten_state_dict"),
    "set_element": ("torch.distributed.checkpoint._traverse", "set_element"),
    # the storage record of DCP's file system writer (checkpoint metadata reads and checks it)
    "StorageInfo": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


__all__ = [
    "AsyncCollectiveTensor",
    "C10dWorld",
    "DisableTorchDispatch",
    "DispatchKey",
    "OpOverload",
    "OpOverloadPacket",
    "TensorBase",
    "TorchDispatchMode",
    "VariableFunctions",
    "c10d_functional",
    "unwaited_collectives",
    "c10d_world",
    "current_graph_task_id",
    "disable_current_modes",
    "disabled_torch_function_impl",
    "dispatch_has_kernel_for_dispatch_key",
    "elementwise_prims",
    "foreach_norm",
    "foreach_supported_types",
    "functional_resolve_group",
    "get_default_group",
    "is_torch_function_mode_enabled",
    "jit_get_all_schemas",
    "kernel_default_generator",
    "len_torch_dispatch_stack",
    "make_wrapper_subclass",
    "new_process_group_helper",
    "pytree",
    "queue_autograd_callback",
    "set_c10d_world",
    "set_functional_resolve_group",
    "set_thread_isolation_mode",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    *_LAZY,
]
