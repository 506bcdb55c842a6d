"""FSDP2's policies (PyTorch's names): mixed precision and offloading."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision of ``fully_shard``: parameters are gathered and computed
    with in ``param_dtype``, gradients reduced in ``reduce_dtype`` (default: ``param_dtype``)
    and kept in the parameter's own dtype; floating outputs cast to ``output_dtype``;
    floating inputs cast to ``param_dtype`` when ``cast_forward_inputs``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters (and hence gradients and optimizer state) live in CPU memory; each
    forward copies them to the mesh's device before gathering. On a CPU mesh they are there
    already. ``pin_memory`` pins them where CUDA is available."""

    pin_memory: bool = True
