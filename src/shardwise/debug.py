"""Debugging aids: explain a redistribution before running it, count the communication of a
block per module (``CommDebugMode``), and draw which device holds which block of a DTensor
(``visualize_sharding``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import torch

from . import dispatch as _dispatch  # DTensor ops run: the op layer is loaded
from . import settings
from .comm import CommCounter, CommRecord
from .comm.budget import CommBudget, comm_budget
from .comm.safety import current_description
from .dtensor import DTensor, local_of
from .errors import InvalidArgumentError
from .mesh import DeviceMesh
from .placements import Placement, RaggedShard
from .redistribute import (
    CrossMeshPlan,
    RedistributePlan,
    cross_mesh_lower_bound_bytes,
    lower_bound_bytes,
    plan_cross_mesh,
    plan_redistribute,
)
from .redistribute.cross_mesh import check_meshes
from .spec import validate_placements


def explain_redistribute(
    dtensor: DTensor, placements: Sequence[Placement], device_mesh: DeviceMesh | None = None
) -> RedistributePlan | CrossMeshPlan:
    """The plan ``dtensor.redistribute(placements=placements)`` would run: its steps, each with
    its collective, mesh dim and the bytes this process's devices would receive, and beside
    its ``global_bytes`` the ``lower_bound`` no plan can beat (bytes over all devices). With
    another ``device_mesh``, the ``CrossMeshPlan`` of ``reshard`` to that mesh, with its bound."""
    spec = local_of(dtensor).spec
    if device_mesh is not None and device_mesh != spec.mesh:
        target = validate_placements(dtensor.shape, device_mesh, placements)
        shape, itemsize = tuple(spec.shape), spec.component_dtype.itemsize
        check_meshes(shape, spec.mesh, spec.placements, device_mesh, target)
        plan = plan_cross_mesh(shape, itemsize, spec.mesh, spec.placements, device_mesh, target)
        bound = cross_mesh_lower_bound_bytes(
            shape, itemsize, spec.mesh, spec.placements, device_mesh, target
        )
        return dataclasses.replace(plan, lower_bound=bound)
    target = validate_placements(dtensor.shape, dtensor.device_mesh, placements)
    plan = plan_redistribute(spec, target, spread=True)
    bound = lower_bound_bytes(
        spec.mesh, tuple(spec.shape), dtensor.element_size(), spec.placements, target
    )
    return dataclasses.replace(plan, lower_bound=bound)



# ----- CommDebugMode -------------------------------------------------------------------------

# torch's functional collectives and c10d ops (trailing "_" dropped), by name, and the kind
# shardwise counts them as (torch counts distribute_tensor's scatter as c10d.scatter_)
_TORCH_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "allgather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "broadcast": "broadcast",
    "scatter": "scatter",
}


def _kind(key: object) -> str | None:
    """The kind (``"all_gather"``) a PyTorch collective op names, None for another key."""
    if isinstance(key, str):
        return None
    name = str(getattr(key, "_opname", None) or getattr(key, "__name__", key))
    name = name.rsplit(".", 1)[-1].split("_coalesced")[0]
    return _TORCH_COLLECTIVES.get(name[:-1] if name.endswith("_") else name)


class CommCounts(Counter):
    """Collective counts by kind (``"all_gather"``...). PyTorch's keys work too:
    ``counts[torch.ops._c10d_functional.all_gather_into_tensor]`` reads ``counts["all_gather"]``,
    and the counts equal a mapping keyed by PyTorch's ops that counts the same
    (``assertDictEqual(m.comm_module_counts["Global"]["forward"], {funcol.all_reduce: 1})``)."""

    def __missing__(self, key: object) -> int:
        kind = _kind(key)
        return self[kind] if kind is not None else 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        mine: Counter = Counter()
        for counts in (self, other):
            for key, n in counts.items():
                mine[_kind(key) or key] += n if counts is self else -n
        return not any(mine.values())

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  (a mutable mapping, as dict)


class CommDebugMode(CommCounter):
    """PyTorch's ``CommDebugMode`` on ``CommCounter``: inside ``with CommDebugMode() as m:``
    every collective is counted overall and per module of the ``nn.Module`` tree that was
    running (forward or backward), and the modules' DTensor parameters are recorded.

    ``m.comm_module_counts[fqn]["forward" | "backward"]`` are the counts of one module (and its
    children; ``"Global"`` is everything), ``get_comm_counts()`` / ``get_total_counts()`` the
    totals, ``get_sharding_info()`` the placements of each DTensor parameter,
    ``generate_comm_debug_tracing_table()`` all of it as text, with the use of every
    ``comm_budget`` active while it counted (limit, used and remaining per limit).
    """

    def __init__(self) -> None:
        super().__init__()
        self.comm_module_counts: dict[str, dict[str, CommCounts]] = {}
        self._module_records: dict[str, dict[str, list[tuple[CommRecord, str]]]] = {}
        self._parameters: dict[str, dict[str, torch.Tensor]] = {}
        self._depth: dict[str, int] = {}
        self._tracker: Any = None
        # the comm_budget blocks seen while counting, by identity: (budget, nesting depth)
        self._budgets: dict[int, tuple[CommBudget, int]] = {}

    def _note_budgets(self) -> None:
        for depth, budget in enumerate(settings.COMM_BUDGETS.get()):
            self._budgets.setdefault(id(budget), (budget, depth))

    def __enter__(self) -> CommDebugMode:
        from .torch_compat import ModTracker

        for table in (self.comm_module_counts, self._module_records, self._parameters):
            table.clear()
        # "Global" is there from the start, as in torch (a module's entry once it communicates)
        self.comm_module_counts["Global"] = {"forward": CommCounts(), "backward": CommCounts()}
        self.counts.clear()
        self.bytes.clear()
        self.records.clear()
        self.cross_process_bytes.clear()
        self.meta_bytes.clear()
        self._depth = {"Global": 0}
        self._budgets = {}
        self._note_budgets()
        self._tracker = ModTracker()
        self._tracker.register_user_hooks(pre_fw_hook=self._enter_module)
        self._tracker.__enter__()
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._tracker.__exit__(*exc)
        self._tracker = None

    def _enter_module(self, module: torch.nn.Module, _inputs: Any) -> None:
        fqn = self._tracker.get_known_fqn(module)
        if fqn is None:
            return
        self._depth.setdefault(fqn, fqn.count(".") + 1)
        params = dict(module.named_parameters(recurse=False))
        if params:
            self._parameters[fqn] = params

    def add(self, record: CommRecord) -> None:
        super().add(record)
        self._note_budgets()
        tracker = self._tracker
        modules = tracker.parents if tracker is not None else {"Global"}
        phase = "backward" if tracker is not None and tracker.is_bw else "forward"
        what = current_description()
        for fqn in modules:
            counts = self.comm_module_counts.setdefault(
                fqn, {"forward": CommCounts(), "backward": CommCounts()}
            )
            counts[phase][record.kind] += 1
            records = self._module_records.setdefault(fqn, {"forward": [], "backward": []})
            records[phase].append((record, what))

    # ----- PyTorch's queries -------------------------------------------------------------
    def get_comm_counts(self) -> CommCounts:
        """Collectives run, by kind."""
        return CommCounts(self.counts)

    @property
    def comm_counts(self) -> CommCounts:
        """PyTorch's attribute: ``get_comm_counts()``."""
        return self.get_comm_counts()

    def get_total_counts(self) -> int:
        """Collectives run in all."""
        return sum(self.counts.values())

    def get_parameter_info(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{module fqn: {parameter name: parameter}}`` of the modules that ran."""
        return {fqn: dict(params) for fqn, params in self._parameters.items()}

    def get_sharding_info(self) -> dict[str, tuple[Placement, ...]]:
        """``{"module.parameter": placements}`` of every DTensor parameter of the modules that
        ran."""
        return {
            f"{fqn}.{name}": p.placements
            for fqn, params in self._parameters.items()
            for name, p in params.items()
            if isinstance(p, DTensor)
        }

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """The modules that ran, nested, each with its forward and backward collective counts;
        ``noise_level >= 1`` adds the placements of their DTensor parameters, ``>= 2`` every
        collective with its mesh dim and bytes, ``>= 3`` what each one was moving."""
        lines = [f"Global: {self.get_total_counts()} collectives, {self.total_bytes} bytes"]
        for fqn in sorted(self._depth, key=list(self._depth).index):
            indent = "  " * self._depth[fqn]
            if fqn != "Global":
                lines.append(f"{indent}{fqn}")
            if noise_level >= 1:
                for name, p in self._parameters.get(fqn, {}).items():
                    if isinstance(p, DTensor):
                        lines.append(f"{indent}  *{name}: {list(p.placements)}")
            for phase in ("forward", "backward"):
                counts = self.comm_module_counts.get(fqn, {}).get(phase)
                if not counts:
                    continue
                lines.append(f"{indent}  {phase.upper()} PASS")
                for kind, n in sorted(counts.items()):
                    lines.append(f"{indent}    *{kind}: {n}")
                if noise_level >= 2:
                    for record, what in self._module_records[fqn][phase]:
                        detail = f" ({what})" if noise_level >= 3 and what else ""
                        lines.append(
                            f"{indent}      {record.kind} on mesh dim {record.mesh_dim}: "
                            f"{record.bytes} bytes{detail}"
                        )
        lines += self._budget_lines()
        return "\n".join(lines) + "\n"

    def _budget_lines(self) -> list[str]:
        """Each ``comm_budget`` seen (nested ones indented): per limit, used and remaining."""
        if not self._budgets:
            return []
        lines = ["Communication budgets (bytes this process's devices received):"]
        for budget, depth in self._budgets.values():
            indent = "  " * (depth + 1)
            lines.append(f"{indent}{budget!r}")
            for scope, limit, used in budget.table_rows():
                if limit is None:
                    lines.append(f"{indent}  {scope}: used {used}, no limit")
                    continue
                left = f"remaining {limit - used}" if used <= limit else f"over by {used - limit}"
                lines.append(f"{indent}  {scope}: limit {limit}, used {used}, {left}")
        return lines

    def log_comm_debug_tracing_table_to_file(
        self, file_name: str = "comm_mode_log.txt", noise_level: int = 3
    ) -> None:
        """Write ``generate_comm_debug_tracing_table(noise_level)`` to ``file_name``."""
        with open(file_name, "w") as f:
            f.write(self.generate_comm_debug_tracing_table(noise_level))

    def generate_json_dump(
        self, file_name: str = "comm_mode_log.json", noise_level: int = 3
    ) -> None:
        """The per-module counts (and, at ``noise_level >= 1``, parameter placements) as JSON."""
        data: dict[str, Any] = {}
        for fqn in self._depth:
            entry: dict[str, Any] = {
                phase: dict(self.comm_module_counts.get(fqn, {}).get(phase, {}))
                for phase in ("forward", "backward")
            }
            if noise_level >= 1:
                entry["parameters"] = {
                    name: [str(pl) for pl in p.placements]
                    for name, p in self._parameters.get(fqn, {}).items()
                    if isinstance(p, DTensor)
                }
            data[fqn] = entry
        with open(file_name, "w") as f:
            json.dump(data, f, indent=2)


# ----- visualize_sharding ----------------------------------------------------------------------


def visualize_sharding(dtensor: DTensor, header: str = "", file: TextIO | None = None) -> str:
    """Print (to ``file``, default stdout) and return a grid of a 0-, 1- or 2-D DTensor's
    blocks, each cell listing the mesh devices that hold it. Devices marked ``*`` hold partial
    values (Partial placements) that sum (or reduce) to the block; devices whose shard is empty
    (uneven sharding) are listed below. Works for any mesh and for devices of other processes."""
    if not isinstance(dtensor, DTensor):
        raise InvalidArgumentError(
            f"visualize_sharding needs a DTensor, got {type(dtensor).__name__}"
        )
    spec = local_of(dtensor).spec
    if spec.ndim > 2:
        raise InvalidArgumentError(
            f"visualize_sharding draws 0-, 1- and 2-D tensors; this DTensor has shape "
            f"{list(spec.shape)} with placements {list(spec.placements)} on {spec.mesh}"
        )
    partial = any(p.is_partial() for p in spec.placements)
    devices = spec.mesh.device_ids
    held = {}
    for d in devices:
        segments = spec.local_segments(d)
        held[d] = ((((0, 1),),) * (2 - spec.ndim) + segments) if spec.ndim < 2 else segments
    sizes = [1] * (2 - spec.ndim) + list(spec.shape)
    rows, cols = (_cuts(sizes[a], [held[d][a] for d in devices]) for a in (0, 1))
    mark = "*" if partial else ""
    table = [["", *(f"{a}:{b}" if spec.ndim else "" for a, b in cols)]]
    for r in rows:
        label = f"{r[0]}:{r[1]}" if spec.ndim == 2 else ""
        table.append([label])
        for c in cols:
            owners = [d for d in devices if _covers(held[d][0], r) and _covers(held[d][1], c)]
            table[-1].append(" ".join(f"{d}{mark}" for d in owners))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [header] if header else []
    lines.append(
        f"DTensor of shape {list(spec.shape)}, placements {list(spec.placements)}, "
        f"on {spec.mesh}"
    )
    for i, row in enumerate(table):
        lines.append(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    for m, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            lines.append(f"ragged dim {p.dim} over mesh dim {m}: extents {list(p.sizes)}")
    empty = [d for d in devices if any(sum(b - a for a, b in runs) == 0 for runs in held[d])]
    if empty:
        lines.append(f"devices holding no elements (uneven shards): {empty}")
    if partial:
        dims = [m for m, p in enumerate(spec.placements) if p.is_partial()]
        lines.append(
            f"* partial values over mesh dims {dims}: the devices of a cell that differ only "
            f"along those dims reduce to its block"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="", file=file or sys.stdout)
    return text


def _cuts(size: int, runs_per_device: list[tuple[tuple[int, int], ...]]) -> list[tuple[int, int]]:
    """The intervals between every run boundary of every device along one tensor dim."""
    points = {0, size}
    for runs in runs_per_device:
        for start, stop in runs:
            points.update((start, stop))
    ordered = sorted(points)
    return [(a, b) for a, b in zip(ordered, ordered[1:], strict=False) if b > a]


def _covers(runs: tuple[tuple[int, int], ...], interval: tuple[int, int]) -> bool:
    return any(start <= interval[0] and interval[1] <= stop for start, stop in runs)


def sharding_cache_stats() -> tuple[int, int]:
    """(hits, misses) of the cache of sharding decisions since it was last cleared: op calls
    on DTensors that found their decision (placements, moves, output metadata) cached, and
    those that decided it."""
    return _dispatch.decision_cache_stats()


def clear_sharding_cache() -> None:
    """Empty the cache of sharding decisions and restart its counts (each call decides
    again once)."""
    _dispatch.clear_sharding_cache()


__all__ = [
    "CommBudget",
    "CommCounter",
    "CommDebugMode",
    "clear_sharding_cache",
    "comm_budget",
    "explain_redistribute",
    "sharding_cache_stats",
    "visualize_sharding",
]
