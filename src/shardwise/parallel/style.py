"""Parallel styles (PyTorch's names and arguments): how one module is sharded on the
tensor-parallel mesh dim and which layouts its inputs and outputs take.

- ``ColwiseParallel``: ``nn.Linear`` weight split by output features (``Shard(0)``, or
  ``InterleavedShard(0, k)`` for merged projections such as QKV), ``nn.Embedding`` by the
  embedding dim; input replicated, output sharded on its last dim.
- ``RowwiseParallel``: ``nn.Linear`` weight split by input features (``Shard(1)``),
  ``nn.Embedding`` by the vocabulary; the output is a pending sum, reduced to ``Replicate``
  (all-reduce) or ``Shard(d)`` (reduce-scatter).
- ``SequenceParallel``: parameters replicated, activations sharded on the sequence dim.
- ``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``: layouts only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..dtensor import DTensor
from ..errors import ParallelPlanError, ParallelStyleError
from ..mesh import DeviceMesh
from ..placements import InterleavedShard, Placement, Replicate, Shard
from .boundary import as_dtensor, local_output, on_tp, on_tp_dim, resolve_tp_dim
from .params import distribute_parameter, replicate_rest


class ParallelStyle:
    """How ``parallelize_module`` shards one module (apply it through a plan)."""

    # where a parameter's values come from (distribute_tensor's src_data_rank; None: every
    # process holds them already, no communication); parallelize_module sets it, as PyTorch's
    src_data_rank: int | None = 0

    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        tp_mesh_dim: int | str | None = None,
        plan_entry: str = "",
    ) -> nn.Module:
        """Shard ``module`` in place on the tp mesh dim and install its layout hooks."""
        tp_dim = resolve_tp_dim(device_mesh, tp_mesh_dim)
        self._apply(module, device_mesh, tp_dim, plan_entry or f"<{type(module).__name__}>")
        return module

    def _apply(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        raise NotImplementedError

    def _place(
        self, module: nn.Module, name: str, mesh: DeviceMesh, tp_dim: int, placement: Placement
    ) -> None:
        """``module.<name>`` as a DTensor with ``placement`` on the tp dim (Replicate else)."""
        placements = on_tp_dim(mesh, tp_dim, placement)
        distribute_parameter(module, name, mesh, placements, tp_dim, self.src_data_rank)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _prepare(
    x: Any,
    mesh: DeviceMesh,
    tp_dim: int,
    given: Placement,
    desired: Placement,
    features: int | None = None,
) -> Any:
    """One input tensor: into a DTensor laid out as ``given``, then moved to ``desired``.
    ``features`` is the global size of its last dim when the module knows it (an
    ``nn.Linear``'s ``in_features``): a local piece sharded there is uneven on some ranks,
    and its own size does not tell the global one."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = None
    if (
        features is not None
        and x.ndim > 0
        and isinstance(given, Shard)
        and given.dim % x.ndim == x.ndim - 1
    ):
        shape = (*x.shape[:-1], features)
    x = as_dtensor(x, mesh, on_tp_dim(mesh, tp_dim, given), shape)
    return on_tp(x, mesh, tp_dim, desired)


def _fail_module(style: ParallelStyle, module: nn.Module, entry: str, fits: str) -> None:
    raise ParallelStyleError(
        f"plan entry {entry}: {type(style).__name__} shards {fits}, but the module is "
        f"{type(module).__name__} ({module})"
    )


def _check_divides(
    entry: str, what: str, size: int, module: nn.Module, mesh: DeviceMesh, tp_dim: int
) -> None:
    n = mesh.shape[tp_dim]
    if size % n:
        shapes = {k: list(v.shape) for k, v in module.named_parameters(recurse=False)}
        raise ParallelPlanError(
            f"plan entry {entry}: {what} = {size} of {module} (parameter shapes {shapes}) is "
            f"not divisible by the tensor-parallel mesh dim {tp_dim} of size {n} of {mesh}"
        )


class _LinearStyle(ParallelStyle):
    """Shared input/output handling of the column- and row-wise styles."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None,
        output_layouts: Placement | None,
        use_local_output: bool,
        default_output: Placement,
    ) -> None:
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts or default_output
        self.use_local_output = use_local_output

    def _hooks(
        self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, desired_input: Placement
    ) -> None:
        """Inputs arrive as ``input_layouts`` (default: already as the module wants them)."""
        given = self.input_layouts or desired_input
        features = module.in_features if isinstance(module, nn.Linear) else None

        def pre(_module: nn.Module, args: tuple) -> tuple:
            if not args:
                return args
            return (_prepare(args[0], mesh, tp_dim, given, desired_input, features), *args[1:])

        def post(_module: nn.Module, _args: tuple, out: Any) -> Any:
            if isinstance(out, DTensor):
                out = on_tp(out, mesh, tp_dim, self.output_layouts)
            return local_output(out, self.use_local_output)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


class ColwiseParallel(_LinearStyle):
    """Split the output features: ``nn.Linear`` weight ``Shard(0)`` (bias too), ``nn.Embedding``
    weight ``Shard(1)``. Input ``Replicate`` (``input_layouts`` says how it arrives), output
    ``Shard(-1)`` unless ``output_layouts`` says otherwise.

    ``interleave=k`` shards a merged projection (k blocks, e.g. q, k and v) with
    ``InterleavedShard(0, k)``, so every device holds the same slice of each block and
    ``output.split(size // k, -1)`` stays local; ``num_heads`` checks that every device gets
    whole attention heads (each block's heads divisible by the tp mesh dim)."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        interleave: int = 1,
        num_heads: int | None = None,
    ) -> None:
        natural = Shard(-1) if interleave == 1 else InterleavedShard(-1, interleave)
        super().__init__(
            input_layouts=input_layouts,
            output_layouts=output_layouts,
            use_local_output=use_local_output,
            default_output=natural,
        )
        self.interleave = interleave
        self.num_heads = num_heads

    def _apply(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        k = self.interleave
        if isinstance(module, nn.Linear):
            out = module.out_features
            if out % k:
                raise ParallelPlanError(
                    f"plan entry {entry}: interleave={k} does not divide the {out} output "
                    f"features of {module} (weight shape {list(module.weight.shape)})"
                )
            if self.num_heads is not None:
                _check_divides(entry, "num_heads", self.num_heads, module, mesh, tp_dim)
                if (out // k) % self.num_heads:
                    raise ParallelPlanError(
                        f"plan entry {entry}: {out // k} features per block of {module} "
                        f"(weight shape {list(module.weight.shape)}) do not split into "
                        f"num_heads={self.num_heads} heads"
                    )
            shard = Shard(0) if k == 1 else InterleavedShard(0, k)
            for name in ("weight", "bias"):
                self._place(module, name, mesh, tp_dim, shard)
        elif isinstance(module, nn.Embedding) and k == 1:
            self._place(module, "weight", mesh, tp_dim, Shard(1))
        else:
            _fail_module(self, module, entry, "nn.Linear (or nn.Embedding without interleave)")
        replicate_rest(module, mesh, tp_dim, self.src_data_rank)
        self._hooks(module, mesh, tp_dim, Replicate())


class RowwiseParallel(_LinearStyle):
    """Split the input features: ``nn.Linear`` weight ``Shard(1)`` (bias replicated), input
    ``Shard(-1)``; ``nn.Embedding`` weight ``Shard(0)`` (the vocabulary), input replicated.
    The output is a pending sum, reduced to ``output_layouts`` (default ``Replicate``)."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__(
            input_layouts=input_layouts,
            output_layouts=output_layouts,
            use_local_output=use_local_output,
            default_output=Replicate(),
        )

    def _apply(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        if isinstance(module, nn.Linear):
            self._place(module, "weight", mesh, tp_dim, Shard(1))
            desired: Placement = Shard(-1)
        elif isinstance(module, nn.Embedding):
            self._place(module, "weight", mesh, tp_dim, Shard(0))
            desired = Replicate()
        else:
            _fail_module(self, module, entry, "nn.Linear or nn.Embedding")
        replicate_rest(module, mesh, tp_dim, self.src_data_rank)
        self._hooks(module, mesh, tp_dim, desired)


class SequenceParallel(ParallelStyle):
    """Parameters replicated (norms, dropout...), activations sharded on ``sequence_dim``: the
    input arrives sharded there (a replicated one is split locally, without communication) and
    the output stays sharded."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        shard = Shard(self.sequence_dim)
        replicate_rest(module, mesh, tp_dim, self.src_data_rank)

        def pre(_module: nn.Module, args: tuple) -> tuple:
            if not args:
                return args
            return (_prepare(args[0], mesh, tp_dim, shard, shard), *args[1:])

        def post(_module: nn.Module, _args: tuple, out: Any) -> Any:
            if isinstance(out, DTensor):
                out = on_tp(out, mesh, tp_dim, shard)
            return local_output(out, self.use_local_output)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


Layouts = Placement | Sequence[Placement | None] | None


def _as_tuple(layouts: Layouts) -> tuple[Placement | None, ...] | None:
    if layouts is None:
        return None
    return (layouts,) if isinstance(layouts, Placement) else tuple(layouts)


class _Inputs:
    """Positional and keyword input layouts of the Prepare styles."""

    def __init__(
        self,
        input_layouts: Layouts,
        desired_input_layouts: Layouts,
        input_kwarg_layouts: dict[str, Placement] | None,
        desired_input_kwarg_layouts: dict[str, Placement] | None,
        use_local_input: bool,
    ) -> None:
        given, desired = _as_tuple(input_layouts), _as_tuple(desired_input_layouts)
        if (given is None) != (desired is None) or (given and len(given) != len(desired)):
            raise ParallelPlanError(
                f"input_layouts {given} and desired_input_layouts {desired} must have the same "
                f"length (None where an input is left alone)"
            )
        kw, kw_desired = input_kwarg_layouts or {}, desired_input_kwarg_layouts or {}
        if set(kw) != set(kw_desired):
            raise ParallelPlanError(
                f"input_kwarg_layouts {kw} and desired_input_kwarg_layouts {kw_desired} must "
                f"name the same keyword arguments"
            )
        self.pairs = list(zip(given or (), desired or (), strict=True))
        self.kw = {k: (kw[k], kw_desired[k]) for k in kw}
        for pair in self.pairs + list(self.kw.values()):
            if pair[0] is not None and pair[1] is None:
                raise ParallelPlanError(
                    f"input layout {pair[0]} has no desired layout (input_layouts {given}, "
                    f"desired_input_layouts {desired}, keyword layouts {self.kw})"
                )
        self.use_local = use_local_input

    def install(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        def convert(x: Any, pair: tuple) -> Any:
            given, desired = pair
            if given is None or not isinstance(x, torch.Tensor):
                return x
            return local_output(_prepare(x, mesh, tp_dim, given, desired), self.use_local)

        def pre(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
            if len(args) < len(self.pairs):
                raise ParallelPlanError(
                    f"plan entry {entry}: {len(self.pairs)} input layouts for "
                    f"{type(_module).__name__}, but it got {len(args)} positional inputs"
                )
            args = tuple(
                convert(a, self.pairs[i]) if i < len(self.pairs) else a for i, a in enumerate(args)
            )
            kwargs = {k: convert(v, self.kw[k]) if k in self.kw else v for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)


class _Outputs:
    def __init__(self, output_layouts: Layouts, desired_output_layouts: Layouts, use_local: bool):
        given, desired = _as_tuple(output_layouts), _as_tuple(desired_output_layouts)
        if given is None or desired is None or len(given) != len(desired):
            raise ParallelPlanError(
                f"output_layouts {given} and desired_output_layouts {desired} must have the "
                f"same length"
            )
        self.pairs = list(zip(given, desired, strict=True))
        self.use_local = use_local

    def install(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        def post(_module: nn.Module, _args: tuple, out: Any) -> Any:
            single = not isinstance(out, (tuple, list))
            outs = (out,) if single else tuple(out)
            if len(outs) != len(self.pairs):
                raise ParallelPlanError(
                    f"plan entry {entry}: {len(self.pairs)} output layouts for "
                    f"{type(_module).__name__}, but it returned {len(outs)} outputs"
                )
            done = []
            for x, (given, desired) in zip(outs, self.pairs, strict=True):
                if given is not None and isinstance(x, torch.Tensor):
                    x = local_output(_prepare(x, mesh, tp_dim, given, desired), self.use_local)
                done.append(x)
            return done[0] if single else type(out)(done)

        module.register_forward_hook(post)


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs from ``input_layouts`` to ``desired_input_layouts`` (one per
    positional input, None to leave one alone; keyword inputs by name)."""

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.inputs = _Inputs(
            input_layouts,
            desired_input_layouts,
            input_kwarg_layouts,
            desired_input_kwarg_layouts,
            use_local_output,
        )

    def _apply(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        self.inputs.install(module, mesh, tp_dim, entry)


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs from ``output_layouts`` to ``desired_output_layouts``."""

    def __init__(
        self,
        *,
        output_layouts: Layouts,
        desired_output_layouts: Layouts,
        use_local_output: bool = True,
    ) -> None:
        self.outputs = _Outputs(output_layouts, desired_output_layouts, use_local_output)

    def _apply(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        self.outputs.install(module, mesh, tp_dim, entry)


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module."""

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Layouts,
        desired_output_layouts: Layouts,
        use_local_output: bool = True,
    ) -> None:
        self.inputs = _Inputs(
            input_layouts,
            desired_input_layouts,
            input_kwarg_layouts,
            desired_input_kwarg_layouts,
            use_local_input,
        )
        self.outputs = _Outputs(output_layouts, desired_output_layouts, use_local_output)

    def _apply(self, module: nn.Module, mesh: DeviceMesh, tp_dim: int, entry: str) -> None:
        self.inputs.install(module, mesh, tp_dim, entry)
        self.outputs.install(module, mesh, tp_dim, entry)
