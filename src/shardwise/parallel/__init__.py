"""Module-level parallelism: tensor parallel plans and styles, data parallel (PyTorch's names)."""

from .fully_shard import fully_shard
from .replicate import replicate

__all__ = ["fully_shard", "replicate"]
