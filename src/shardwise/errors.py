"""Exception classes: everything a user can cause derives from ``ShardwiseError``."""

from __future__ import annotations


class ShardwiseError(Exception):
    """Base class of every error shardwise raises on bad use."""


class InvalidPlacementError(ShardwiseError, ValueError):
    """A placement does not fit the tensor or the mesh (dim out of range, bad interleave...)."""


class MeshError(ShardwiseError, ValueError):
    """A device mesh is malformed, or tensors live on different meshes."""


class LayoutError(ShardwiseError, ValueError):
    """A TF-style layout is malformed or does not fit the tensor."""


class PackError(ShardwiseError, ValueError):
    """``pack``/``from_local`` components do not fit the layout or placements."""


class InvalidArgumentError(ShardwiseError, ValueError):
    """TF's InvalidArgumentError: an argument of the right type with a wrong value."""


class LocalComponentsError(ShardwiseError, RuntimeError):
    """A single local tensor was asked for where the process owns several devices."""


class UnsupportedOpError(ShardwiseError, NotImplementedError):
    """An aten op has no sharding rule or strategy registered."""


class ImplicitRedistributeError(ShardwiseError, RuntimeError):
    """An op needs its inputs redistributed while implicit redistribution is off."""


class ShardwiseTypeError(ShardwiseError, TypeError):
    """An argument of the wrong kind: a variable where a tensor is needed, mixed dtypes..."""


class CollectiveError(ShardwiseError, RuntimeError):
    """A collective across processes failed: a peer process died or the transport broke."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective across processes did not complete within the collective timeout."""


class CollectiveMismatchError(CollectiveError):
    """Processes entered different collectives, or the same one on different tensors
    (found by the debug checks, ``shardwise.set_debug_checks(True)``)."""


class StrategyValidationError(ShardwiseError, AssertionError):
    """A sharding strategy, forced on sample inputs, gave a value or placements that differ
    from single-device PyTorch (``shardwise.validate_strategy``)."""
