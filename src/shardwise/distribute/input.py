"""Distributed input (spec 1B.4): a dataset of GLOBAL batches split per replica, or a dataset
function per input pipeline; ``InputContext`` and ``ValueContext``.

Split rule (what TF 2.21 does, measured): each batch of actual size b is cut into N contiguous
pieces of ``ceil(b / N)`` elements in replica order; the last non-empty piece may be shorter and
the replicas after it get EMPTY batches (leading dim 0) and still run the step. So 4 over 3 is
``[0,1] | [2,3] | []`` and a last batch ``[8, 9]`` over 2 is ``[8] | [9]``.
Every worker reads the whole stream and keeps its own replicas' slices (global replica order),
so W processes give the same per-replica batches as one process with all the replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DistributeValueError
from .context import StrategyLike as Strategy  # by its shape: strategy.py imports this module
from .values import leaves, map_nest, regroup


@dataclass(frozen=True)
class InputContext:
    """What ``dataset_fn`` of ``distribute_datasets_from_function`` knows about its pipeline."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync`` (must divide evenly)."""
        if global_batch_size % self.num_replicas_in_sync:
            raise DistributeValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclass(frozen=True)
class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` gets."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def split_sizes(batch: int, num_replicas: int) -> list[int]:
    """Per-replica sizes of one batch of ``batch`` elements: pieces of ``ceil(batch / N)`` in
    replica order, the last non-empty one what is left, then empty ones."""
    piece = -(-batch // num_replicas)
    return [max(0, min(piece, batch - r * piece)) for r in range(num_replicas)]


def _leading(batch: Any) -> int:
    tensors = [t for t in leaves(batch) if isinstance(t, torch.Tensor)]
    if not tensors or any(t.ndim == 0 for t in tensors):
        raise DistributeValueError(
            "Call the `batch` method on the input dataset in order to be able to split your "
            "input across replicas: its elements must be tensors of rank >= 1 (expected rank "
            ">= 1, got a scalar or non-tensor element)"
        )
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) > 1:
        raise DistributeValueError(
            f"the tensors of one batch have different leading sizes {sorted(sizes)}"
        )
    return tensors[0].shape[0]


class DistributedDataset:
    """Iterates a dataset of global batches as per-replica batches: each step is the batch's
    structure with a ``PerReplica`` per tensor (plain tensors with one local replica). Each
    ``iter`` restarts."""

    def __init__(self, strategy: Strategy, dataset: Iterable[Any]) -> None:
        self._strategy = strategy
        self._dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        ext = self._strategy.extended
        n = self._strategy.num_replicas_in_sync
        devices = ext._torch_devices()
        first = ext._global_replica_id(0)
        for batch in self._dataset:
            if n == 1:  # one replica: the batch as it is, on its device
                yield map_nest(
                    lambda t: t.to(devices[0]) if isinstance(t, torch.Tensor) else t, batch
                )
                continue
            sizes = split_sizes(_leading(batch), n)
            parts = []
            for i, device in enumerate(devices):
                r = first + i
                start = sum(sizes[:r])
                stop = start + sizes[r]
                parts.append(
                    map_nest(lambda t, a=start, b=stop, d=device: _slice(t, a, b, d), batch)
                )
            yield regroup(parts)


def _slice(t: Any, start: int, stop: int, device: torch.device) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return t[start:stop].to(device)


class DistributedDatasetFromFunction:
    """Per-replica batches from ``dataset_fn(InputContext)``: local replicas take consecutive
    batches; when the data runs out mid-step the remaining replicas get empty batches."""

    def __init__(
        self, strategy: Strategy, dataset_fn: Callable[[InputContext], Iterable[Any]]
    ) -> None:
        self._strategy = strategy
        self._dataset_fn = dataset_fn

    def __iter__(self) -> Iterator[Any]:
        ext = self._strategy.extended
        n_local = ext._num_local
        workers = self._strategy.num_replicas_in_sync // n_local
        worker = ext._global_replica_id(0) // n_local
        ctx = InputContext(workers, worker, self._strategy.num_replicas_in_sync)
        iterator = iter(self._dataset_fn(ctx))
        devices = ext._torch_devices()
        while True:
            parts: list[Any] = []
            for device in devices:
                try:
                    batch = next(iterator)
                except StopIteration:
                    if not parts:
                        return
                    batch = map_nest(
                        lambda t: t[:0] if isinstance(t, torch.Tensor) else t, parts[0]
                    )
                parts.append(
                    map_nest(
                        lambda t, d=device: t.to(d) if isinstance(t, torch.Tensor) else t, batch
                    )
                )
            yield regroup(parts)
