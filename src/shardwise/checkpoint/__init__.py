"""Checkpoints on torch.distributed.checkpoint (DCP) that reshard on load.

``dcp.save`` / ``dcp.load`` work unchanged on state dicts holding shardwise DTensors
(``protocol``); ``save`` / ``load`` here handle a whole training state in one call, and
``load`` treats a checkpoint as untrusted data (``metadata``, ``storage``, ``extra``).
"""

from .. import dispatch as _dispatch  # noqa: F401  (DTensor ops run: the op layer is loaded)
from ..errors import (
    CheckpointCorruptError,
    CheckpointFileMissingError,
    CheckpointNotFoundError,
    CheckpointPathError,
    UnsafeCheckpointError,
)
from .training_state import load, save

__all__ = [
    "CheckpointCorruptError",
    "CheckpointFileMissingError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "UnsafeCheckpointError",
    "load",
    "save",
]
