"""Checkpoints on torch.distributed.checkpoint (DCP) that reshard on load.

``dcp.save`` / ``dcp.load`` work unchanged on state dicts holding shardwise DTensors
(``protocol``); ``save`` / ``load`` here handle a whole training state in one call.
"""

from .training_state import load, save

__all__ = ["load", "save"]
