"""The drop-in switch: PyTorch's DTensor module names resolve to shardwise.

``as_torch()`` puts shardwise's modules in ``sys.modules`` under the names libraries import
(``torch.distributed.tensor`` and its ``placement_types``, ``device_mesh``, ``parallel``,
``debug``, ``experimental``, ``_utils``; ``torch.distributed.device_mesh``;
``torch.distributed.fsdp``'s FSDP2 names), so code that cannot be edited runs on shardwise.
FSDP1's names (``FullyShardedDataParallel``...) stay torch's. ``torch.distributed.
_functional_collectives`` accepts a shardwise mesh as its group. ``python -m shardwise.as_torch
[-m] SCRIPT [ARGS]`` runs a program with the switch on (``torchrun -m shardwise.as_torch``),
as do ``python -m shardwise.launch --as-torch`` and ``SHARDWISE_AS_TORCH=1`` in a process that
imports shardwise.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

# torch module -> (shardwise modules that answer its names, in order; whether names shardwise
# lacks fall through to torch's module: FSDP1's beside FSDP2's, and torch's private helpers;
# or the only names that do).
# torch.distributed.tensor._api stays torch's: torch's own sharding rules import its DTensor
# lazily (e.g. when torch.compile first loads inductor) and need torch's class.
SHIMS: dict[str, tuple[tuple[str, ...], bool | frozenset[str]]] = {
    "torch.distributed.tensor": (("shardwise",), False),
    "torch.distributed.tensor.placement_types": (("shardwise.placements",), False),
    "torch.distributed.tensor.device_mesh": (("shardwise.mesh",), False),
    "torch.distributed.tensor._dtensor_spec": (("shardwise.spec",), True),
    "torch.distributed.tensor._utils": (("shardwise.geometry",), True),
    "torch.distributed.tensor.parallel": (("shardwise.parallel",), False),
    "torch.distributed.tensor.parallel.style": (("shardwise.parallel",), False),
    "torch.distributed.tensor.parallel.api": (("shardwise.parallel",), False),
    "torch.distributed.tensor.parallel.loss": (("shardwise.parallel",), False),
    "torch.distributed.tensor.debug": (("shardwise.debug",), False),
    "torch.distributed.tensor.experimental": (
        ("shardwise.rules", "shardwise.config", "shardwise"), False
    ),
    "torch.distributed._tensor": (("shardwise",), False),
    "torch.distributed._tensor.placement_types": (("shardwise.placements",), False),
    "torch.distributed._tensor.device_mesh": (("shardwise.mesh",), False),
    "torch.distributed.device_mesh": (("shardwise.mesh",), False),
    # torch's _PhiloxState reads and writes the seed and offset bytes of a generator's state:
    # no DTensor in it. Its RNG tracker (_rng_tracker) stays torch's own business.
    "torch.distributed.tensor._random": ((), frozenset({"_PhiloxState"})),
    "torch.distributed.fsdp": (("shardwise.parallel",), True),
    "torch.distributed._composable.fsdp": (("shardwise.parallel",), True),
}


def _manual_seed(seed: int, device_mesh: Any = None) -> None:
    """torch's ``tensor._random.manual_seed(seed, mesh)``: shardwise draws every DTensor's
    values from torch's default generator, for any mesh (``shardwise.manual_seed``)."""
    from .ops.random import manual_seed

    manual_seed(seed)


def _is_rng_supported_mesh(device_mesh: Any) -> bool:
    """torch's ``tensor._random.is_rng_supported_mesh(mesh)`` (False on CPU meshes in torch):
    shardwise draws each shard's numbers from its own stream on every device type."""
    return True


def _shard_tensor(full_tensor: Any, placements: Any, device_mesh: Any = None) -> Any:
    """torch's ``tensor._api._shard_tensor``: every process holds the whole tensor and keeps its
    own shard of it, without communication (``distribute_tensor(..., src_data_rank=None)``)."""
    from .factories import distribute_tensor

    return distribute_tensor(full_tensor, device_mesh, placements, src_data_rank=None)


def _compute_global_tensor_shape(shape: Any, mesh: Any, placements: Any) -> Any:
    """torch's private ``tensor._utils.compute_global_tensor_shape`` (one mesh dim, as torch's):
    the global shape of a DTensor from this process's local ``shape``, the shapes of every
    process gathered (uneven shards included): a shard dim is their sum, every other dim must
    agree."""
    import torch

    from .dtensor import DTensor
    from .errors import LocalShapeError, UnsupportedOpError
    from .placements import Replicate, Shard

    if len(placements) != 1:
        raise UnsupportedOpError(
            f"compute_global_tensor_shape only supports 1 placement for now, got {placements}"
        )
    if len(placements) != mesh.ndim:
        raise LocalShapeError(
            f"Expected one placement per mesh dim, got {len(placements)} placements "
            f"{list(placements)} for the {mesh.ndim}-D {mesh}"
        )
    (placement,) = placements
    if isinstance(placement, Replicate):
        return torch.Size(shape)
    if not isinstance(placement, Shard):
        raise UnsupportedOpError(
            f"compute_global_tensor_shape: placement {placement!r} is not supported (Shard or "
            f"Replicate; {mesh})"
        )
    mine = torch.tensor([list(shape)], device=mesh.device_of(mesh.local_device_ids[0]))
    every = DTensor.from_local(mine, mesh, [Shard(0)]).full_tensor().tolist()
    dim = placement.dim % len(shape)
    if any(s[:dim] + s[dim + 1:] != every[0][:dim] + every[0][dim + 1:] for s in every):
        raise LocalShapeError(
            f"Non-sharded dimensions should have identical size across ranks: local shapes "
            f"{every} over {mesh} with placements {list(placements)}"
        )
    return torch.Size([*shape[:dim], sum(s[dim] for s in every), *shape[dim + 1:]])


def _to_replicate_tensor(
    self: Any, local_tensor: Any, mesh: Any, mesh_dim: int, current_logical_shape: Any
) -> Any:
    """torch's private ``Shard._to_replicate_tensor`` (``_StridedShard``'s too): this
    process's piece under this placement on ``mesh_dim`` of a tensor of
    ``current_logical_shape``, gathered whole there (an all-gather along that mesh dim)."""
    from .dtensor import DTensor
    from .placements import Replicate

    placements = [Replicate()] * mesh.ndim
    placements[mesh_dim] = self
    shape = list(current_logical_shape)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * max(shape[d + 1], 1)
    dt = DTensor.from_local(local_tensor, mesh, placements, shape=shape, stride=stride)
    placements[mesh_dim] = Replicate()
    return dt.redistribute(mesh, placements).to_local()


def _clear_sharding_prop_cache() -> None:
    """torch's ``debug._clear_sharding_prop_cache()``: shardwise's cache of sharding
    decisions (``debug.clear_sharding_cache``), its counts restarted."""
    from .debug import clear_sharding_cache

    clear_sharding_cache()


def _get_fast_path_sharding_prop_cache_stats() -> tuple[int, int]:
    """torch's ``debug._get_fast_path_sharding_prop_cache_stats()``, (hits, misses) of its
    sharding-propagation cache: those of shardwise's decision cache, which one op call on
    DTensors reads once (``debug.sharding_cache_stats``)."""
    from .debug import sharding_cache_stats

    return sharding_cache_stats()


# names answered here, before the modules of SHIMS
_OWN: dict[str, dict[str, Any]] = {
    "torch.distributed.tensor._random": {
        "manual_seed": _manual_seed,
        "is_rng_supported_mesh": _is_rng_supported_mesh,
    },
    "torch.distributed.tensor._utils": {
        "compute_global_tensor_shape": _compute_global_tensor_shape,
    },
    "torch.distributed.tensor.debug": {
        "_clear_sharding_prop_cache": _clear_sharding_prop_cache,
        "_get_fast_path_sharding_prop_cache_stats": _get_fast_path_sharding_prop_cache_stats,
    },
}
# torch's private methods of its placements that communicate, given to shardwise's shard
# placements by the switch (shardwise's placements are data: they never communicate)
_PLACEMENT_METHODS: dict[str, Callable[..., Any]] = {"_to_replicate_tensor": _to_replicate_tensor}
# torch modules that stay torch's (above: ``_api``) but whose names below answer shardwise's
_PATCHED: dict[str, dict[str, Any]] = {
    "torch.distributed.tensor._api": {"_shard_tensor": _shard_tensor},
}
# names torch.distributed itself exports from these modules
_TOP_LEVEL = ("DeviceMesh", "init_device_mesh")
# torch modules that use DTensors rather than implement them (distributed checkpoint and its
# state-dict helpers): the names they bound from SHIMS' modules before the switch (importing
# torch's FSDP loads them) are rebound to shardwise's
_USERS = ("torch.distributed._state_dict_utils", "torch.distributed.checkpoint")


class _Shim(types.ModuleType):
    """A torch module name whose attributes are shardwise's."""

    def __init__(self, name: str, sources: tuple[str, ...], real: types.ModuleType | None):
        super().__init__(name, f"shardwise's stand-in for {name} (shardwise.as_torch)")
        self.__dict__["_sources"] = sources
        self.__dict__["_real"] = real
        self.__dict__["__shardwise__"] = True
        if hasattr(real, "__path__"):  # torch's submodules not shimmed still import
            self.__dict__["__path__"] = real.__path__

    def __getattr__(self, name: str) -> Any:
        if name == "__all__":
            real = self.__dict__["_real"]
            names = getattr(real, "__all__", [])
            return [n for n in names if self._lookup(n) is not _MISSING]
        value = self._lookup(name)
        if value is _MISSING:
            passed = SHIMS[self.__name__][1]
            passed = passed if isinstance(passed, frozenset) else frozenset()
            answers = ", ".join(self.__dict__["_sources"]) or "only " + ", ".join(
                sorted({*_OWN.get(self.__name__, {}), *passed}, key=str.lower)
            )
            raise AttributeError(
                f"shardwise.as_torch: {self.__name__}.{name} has no shardwise counterpart "
                f"(shardwise answers {answers}; see "
                f"docs/api_map.md, 'Running existing PyTorch libraries')"
            )
        return value

    def _lookup(self, name: str) -> Any:
        if name.startswith("__"):
            return _MISSING
        own = _OWN.get(self.__name__, {})
        if name in own:
            return own[name]
        for source in self.__dict__["_sources"]:
            try:
                return getattr(importlib.import_module(source), name)
            except AttributeError:
                continue
        real = self.__dict__["_real"]
        fallback = SHIMS[self.__name__][1]
        passes = fallback is True or (isinstance(fallback, frozenset) and name in fallback)
        return getattr(real, name, _MISSING) if passes and real is not None else _MISSING


_MISSING: Any = object()


def installed() -> bool:
    """Whether the switch is on in this process."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "__shardwise__", False)


def as_torch() -> None:
    """Turn the switch on (idempotent): from here on, imports of PyTorch's DTensor modules
    (``SHIMS``) give shardwise's names, and ``torch.distributed._functional_collectives``
    takes a shardwise mesh as a group. Call it before the library imports them: a name a
    module bound earlier stays torch's (a ``ShardwiseWarning`` says so)."""
    if installed():
        return
    from .errors import ShardwiseWarning

    early = sorted(n for n in SHIMS if n in sys.modules and n != "torch.distributed.device_mesh")
    if early:
        warnings.warn(
            f"shardwise.as_torch: {', '.join(early)} were imported before the switch; names "
            f"bound from them earlier stay torch's",
            ShardwiseWarning,
            stacklevel=2,
        )
    # torch's own modules first, bound to torch's classes (FSDP1 keeps working beside ours)
    real = {}
    for name in SHIMS:
        try:
            real[name] = importlib.import_module(name)
        except ImportError:
            real[name] = None
    from .torch_compat import functional_resolve_group

    resolve_group = functional_resolve_group()  # loads the functional collectives first
    _fill_torch_dtensor_cache()
    for name, (sources, _) in SHIMS.items():
        sys.modules[name] = _Shim(name, sources, real[name])
    for name in SHIMS:  # parents name their children: `import torch.distributed.tensor as t`
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])
    import torch.distributed as dist

    from . import mesh

    for name in _TOP_LEVEL:
        setattr(dist, name, getattr(mesh, name))
    _rebind_users(real)
    for name, names in _PATCHED.items():
        for attr, value in names.items():
            setattr(importlib.import_module(name), attr, value)
    from .placements import Shard

    for attr, method in _PLACEMENT_METHODS.items():
        setattr(Shard, attr, method)
    _accept_meshes(resolve_group)


def _rebind_users(real: dict[str, types.ModuleType | None]) -> None:
    """In the loaded modules of ``_USERS``, replace each name bound to a class or function of
    torch's DTensor modules by the shim's answer for that name, where shardwise has one."""
    users = [m for n, m in list(sys.modules.items())
             if any(n == u or n.startswith(u + ".") for u in _USERS)]
    owners = ("torch.distributed.tensor", "torch.distributed.device_mesh")
    for module in users:
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType) or not str(
                getattr(value, "__module__", "")
            ).startswith(owners):
                continue
            for name, torch_module in real.items():
                if torch_module is None or getattr(torch_module, attr, None) is not value:
                    continue
                mine = sys.modules[name]._lookup(attr)
                if mine is not _MISSING:
                    setattr(module, attr, mine)
                break


def _fill_torch_dtensor_cache() -> None:
    """torch's C++ looks ``torch.distributed.tensor.DTensor`` up once, at the first op on a
    tensor subclass, and sends that class's ops to its ``_op_dispatcher``: run one such op while
    the name is still torch's, so shardwise's DTensor is never taken for torch's."""
    import torch

    from .torch_compat import make_wrapper_subclass

    class _Probe(torch.Tensor):
        @staticmethod
        def __new__(cls, shape: tuple[int, ...]) -> _Probe:
            return make_wrapper_subclass(cls, shape)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return torch.empty(0)

    _Probe((1,)).detach()


def _accept_meshes(original: Callable[..., Any]) -> None:
    """Let the functional collectives take a shardwise mesh (or ``(mesh, dim)``) as their group,
    as they take torch's: the group of this process along the mesh dim."""
    from .errors import MeshError
    from .mesh import DeviceMesh
    from .torch_compat import set_functional_resolve_group

    def resolve_group(group: Any, tag: str = "") -> Any:
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise MeshError(
                    f"a functional collective over the {group.ndim}-D {group} needs one mesh "
                    f"dim: pass (mesh, dim) or a 1-D sub-mesh"
                )
            return group.get_group(0)
        if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
            return group[0].get_group(group[1])
        return original(group, tag)

    set_functional_resolve_group(resolve_group)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.as_torch [-m] SCRIPT [ARGS]``: run a program with the switch on."""
    args = list(sys.argv[1:] if argv is None else argv)
    module = bool(args) and args[0] == "-m"
    args = args[1:] if module else args
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    as_torch()
    sys.argv = args
    if module:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        import os

        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
