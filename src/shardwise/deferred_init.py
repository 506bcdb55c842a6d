"""Deferred initialization: build a module on the meta device (no memory), shard its
parameters while they are still meta, then materialize each device's shard directly.

``materialize_module`` gives every meta parameter and buffer real storage (a DTensor keeps its
placements, each device allocating only its piece) and then runs the modules' own
``reset_parameters`` on the sharded parameters, children before parents and siblings in
registration order: the order a normal construction runs them in. Random initializers on
DTensors draw each device's shard only (``rng.py``), so after ``shardwise.manual_seed(s)`` the
values equal the module built normally with its parameters sharded alike, and nothing past the
shards is allocated.

PyTorch's own flow works too: a module built under ``torch.device("meta")`` keeps its meta
DTensors through the sharding calls, ``module.to_empty(device=...)`` allocates each device's
piece, and the model's own init (``nn.init.*``, buffers it recomputes) fills them. The sharding
calls keep what they attached to a parameter (gradient hooks, shardwise's attributes) across
``Module._apply``, which ``to_empty`` (and ``to``, ``cuda``, ``half``) swaps DTensors through.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from . import dispatch as _dispatch  # noqa: F401  (DTensor ops run: the op layer is loaded)
from .dtensor import DTensor, local_of
from .errors import DeferredInitError
from .placements import Placement
from .spec import DTensorSpec

M = TypeVar("M", bound=nn.Module)

_ROOT_FLAG = "_shardwise_deferred_root"  # the module deferred_init returned


def deferred_init(fn: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """``fn(*args, **kwargs)`` under ``torch.device("meta")``: the module's structure without
    its memory. Sharding calls on its submodules then leave them meta, and the call on this
    root (or ``materialize_module``) initializes the whole tree in construction order."""
    with torch.device("meta"):
        module = fn(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise DeferredInitError(
            f"deferred_init expects fn to build an nn.Module, got {type(module).__name__}"
        )
    setattr(module, _ROOT_FLAG, True)
    return module


def is_meta(tensor: torch.Tensor) -> bool:
    """True for a meta tensor and for a DTensor whose pieces are meta."""
    if isinstance(tensor, DTensor):
        pieces = local_of(tensor).pieces
        return bool(pieces) and pieces[0].is_meta
    return tensor.is_meta


def is_deferred(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) is still meta."""
    return any(is_meta(t) for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def placed_meta(tensor: DTensor, placements: Sequence[Placement]) -> DTensor:
    """A meta DTensor re-placed: only its metadata changes, no data moves."""
    spec = local_of(tensor).spec.with_placements(tuple(placements))
    mesh = spec.mesh
    components = [
        torch.empty(spec.local_shape(d), dtype=tensor.dtype, device="meta")
        for d in mesh.local_device_ids
    ]
    return DTensor(components, spec, requires_grad=tensor.requires_grad)


def materialize_if_root(module: nn.Module) -> None:
    """What the sharding calls (``parallelize_module``, ``replicate``, ``fully_shard``) run
    last. A tree built by ``deferred_init`` is materialized when the call reaches its root
    (calls on its submodules wait: the root initializes everything in construction order).
    A module built under plain ``torch.device("meta")`` stays meta, as PyTorch's calls (FSDP2
    included) leave it, for PyTorch's flow: ``to_empty``, then the model's own init
    (``reset_parameters``, ``init_weights``). Either way ``module`` keeps its parameters' hooks
    across ``to_empty``."""
    keep_hooks_across_apply(module)
    if is_deferred(module) and getattr(module, _ROOT_FLAG, False):
        materialize_module(module)


def _unresettable(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` holding meta tensors with no ``reset_parameters`` to fill
    them."""
    return [
        m for m in _post_order(module)
        if any(is_meta(t) for t in _own_tensors(m))
        and not callable(getattr(m, "reset_parameters", None))
    ]


def keep_hooks_across_apply(module: nn.Module) -> None:
    """Make ``module._apply`` (behind ``to_empty``, ``to``, ``cuda``...) keep what sharding
    attached to its DTensor parameters and buffers. ``_apply`` swaps a DTensor parameter's
    contents with the converted one (``torch.utils.swap_tensors``): the Python object stays
    but its autograd hooks stay behind on the old tensor and its attributes are exchanged.
    Idempotent; an ancestor's ``_apply`` reaches it through the children's."""
    if "_apply" not in module.__dict__:
        module._apply = types.MethodType(_apply, module)


def _apply(
    self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
) -> nn.Module:
    """``Module._apply`` of ``self``'s class, then each converted DTensor gets back the hooks
    and shardwise attributes its predecessor carried (named ``_apply``: a pickled module
    finds it again by that name)."""
    subs = self.modules() if recurse else [self]
    held = [
        (table, name, t, t.__dict__.get("_components"), _kept(t))
        for sub in subs
        for table in (sub._parameters, sub._buffers)
        for name, t in table.items()
        if isinstance(t, DTensor)
    ]
    type(self)._apply(self, fn, recurse)
    for table, name, old, components, kept in held:
        new = table.get(name)
        swapped = new is not old or new.__dict__.get("_components") is not components
        if new is not None and swapped:
            _restore(new, kept)
    return self


def materialize_module(module: M, device: torch.device | str = "cpu") -> M:
    """Allocate every meta parameter and buffer of ``module`` (DTensors: each device's piece
    only; plain tensors: on ``device``) and run ``reset_parameters`` to fill them."""
    for owner in _unresettable(module):
        names = [n for n, t in _own_named_tensors(owner) if is_meta(t)]
        raise DeferredInitError(
            f"cannot materialize {type(owner).__name__} (meta tensors {names}, shapes "
            f"{[list(t.shape) for _, t in _own_named_tensors(owner) if is_meta(t)]}): it "
            f"has no reset_parameters() to initialize them; give it one (or call "
            f"module.to_empty(device=...) and initialize it yourself)"
        )
    owners = [m for m in _post_order(module) if any(is_meta(t) for t in _own_tensors(m))]
    resetting = {id(m) for m in owners}
    allocated: dict[int, torch.Tensor] = {}  # a tied parameter is allocated once
    for m in _post_order(module):
        if id(m) in resetting:
            _allocate(m, torch.device(device), allocated)
    # A tied tensor keeps the values its first owner gave it, as when a model ties weights
    # after constructing both owners (each owner's reset still advances the generator).
    first_values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for m in _post_order(module):
            if id(m) in resetting or _resets_children(m, resetting):
                m.reset_parameters()
                for t in _own_tensors(m):
                    if id(t) not in first_values and _owner_count(module, t) > 1:
                        first_values[id(t)] = (t, t.detach().clone())
        for tensor, value in first_values.values():
            tensor.copy_(value)
    for m in module.modules():
        if _ROOT_FLAG in m.__dict__:
            delattr(m, _ROOT_FLAG)
    return module


def _resets_children(module: nn.Module, resetting: set[int]) -> bool:
    """A parameter-free module whose ``reset_parameters`` ran at construction (after its
    children's) must run again here so the generator advances as it did."""
    own = getattr(type(module), "reset_parameters", None)
    return own is not None and any(id(m) in resetting for m in module.modules() if m is not module)


def _owner_count(module: nn.Module, tensor: torch.Tensor) -> int:
    return sum(any(t is tensor for t in _own_tensors(m)) for m in module.modules())


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _own_named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return (t for _, t in _own_named_tensors(module))


def _allocate(module: nn.Module, device: torch.device, allocated: dict[int, torch.Tensor]) -> None:
    """Replace the meta parameters and buffers of ``module`` (not its children) by
    uninitialized real ones with the same sharding (``allocated``: those made so far)."""
    for table, make in (
        (module._parameters, lambda t: nn.Parameter(_empty_like(t, device), t.requires_grad)),
        (module._buffers, lambda t: _empty_like(t, device)),
    ):
        for name, tensor in list(table.items()):
            if tensor is not None and is_meta(tensor):
                if id(tensor) not in allocated:
                    allocated[id(tensor)] = _carry_over(tensor, make(tensor))
                table[name] = allocated[id(tensor)]


def _carry_over(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """What sharding attached to a meta tensor stays with its real replacement: gradient
    hooks (a style's gradient placement) and shardwise's bookkeeping attributes."""
    _restore(new, _kept(old))
    return new


_Kept = tuple[Any, Any, dict[str, Any]]


def _kept(tensor: torch.Tensor) -> _Kept:
    """A tensor's gradient hooks and ``_shardwise*`` attributes."""
    attrs = {k: v for k, v in vars(tensor).items() if k.startswith("_shardwise")}
    return tensor._backward_hooks, getattr(tensor, "_post_accumulate_grad_hooks", None), attrs


def _restore(tensor: torch.Tensor, kept: _Kept) -> None:
    """Give ``tensor`` the hooks and attributes ``_kept`` took; assigning the hook dicts
    registers them with this tensor's autograd node."""
    hooks, post, attrs = kept
    if hooks:
        tensor._backward_hooks = hooks
    if post:
        tensor._post_accumulate_grad_hooks = post
    for key, value in attrs.items():
        setattr(tensor, key, value)


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return torch.empty_like(tensor, device=device)
    spec: DTensorSpec = local_of(tensor).spec
    mesh = spec.mesh
    components = [
        torch.empty_like(c, device=mesh.device_of(d))
        for c, d in zip(local_of(tensor).pieces, mesh.local_device_ids, strict=True)
    ]
    return DTensor(components, spec)
