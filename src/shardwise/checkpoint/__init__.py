"""Checkpoints on torch.distributed.checkpoint (DCP) that reshard on load.

``dcp.save`` / ``dcp.load`` work unchanged on state dicts holding shardwise DTensors
(``protocol``); ``save`` / ``load`` here handle a whole training state in one call, and
``load`` treats a checkpoint as untrusted data (``metadata``, ``storage``, ``extra``).
"""

from ..errors import CheckpointCorruptError, UnsafeCheckpointError
from .training_state import load, save

__all__ = ["CheckpointCorruptError", "UnsafeCheckpointError", "load", "save"]
