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


class DTensorAsLocalError(PackError, RuntimeError):
    """A DTensor given where local tensors are expected (``from_local``, ``pack``): also a
    RuntimeError, as PyTorch's ``from_local`` raises for it."""


class InvalidArgumentError(ShardwiseError, ValueError):
    """TF's InvalidArgumentError: an argument of the right type with a wrong value."""


class OpArgumentError(InvalidArgumentError, RuntimeError):
    """An op got DTensor operands that single-device PyTorch rejects as well (shapes that do
    not broadcast or multiply, mismatched dtypes...): TF raises InvalidArgumentError there and
    PyTorch RuntimeError, so this is both a ``ValueError`` and a ``RuntimeError``."""


class LocalShapeError(InvalidPlacementError, RuntimeError):
    """Processes' local shapes do not fit together under the placements given for them (a
    dim they do not shard differs, or the placements do not match the mesh): PyTorch raises
    RuntimeError there, so this is both a ``ValueError`` and a ``RuntimeError``."""


class NonLeafTensorError(ShardwiseError, RuntimeError):
    """``distribute_tensor`` got a tensor autograd made (not a leaf): a RuntimeError, as
    PyTorch's ``distribute_tensor`` raises for it."""


class LocalComponentsError(ShardwiseError, RuntimeError):
    """A single local tensor was asked for where the process owns several devices."""


class UnsupportedOpError(ShardwiseError, NotImplementedError):
    """An aten op has no sharding rule or strategy registered."""


class DTensorCollectiveError(UnsupportedOpError):
    """A ``torch.distributed`` collective (a c10d op) was called on a DTensor: a DTensor is one
    global tensor whose pieces shardwise moves itself (``redistribute``, ``full_tensor``); a
    rank's own piece is ``to_local()``."""


class ImplicitRedistributeError(ShardwiseError, RuntimeError):
    """An op needs its inputs redistributed while implicit redistribution is off."""


class CommBudgetExceededError(ShardwiseError, RuntimeError):
    """Communication inside ``comm_budget(..., on_exceed="raise")`` would go (or, where the
    plan was not known ahead, went) past one of its limits."""


class ShardwiseTypeError(ShardwiseError, TypeError):
    """An argument of the wrong kind: a variable where a tensor is needed, mixed dtypes..."""


class VariableInputError(InvalidArgumentError, ShardwiseTypeError):
    """A variable where TF DTensor takes tensors (``pack``'s components): TF 2.21 raises
    InvalidArgumentError ("Variable input is not supported"), older TF a TypeError, so this is
    both a ``ValueError`` and a ``TypeError``."""


class CollectiveError(ShardwiseError, RuntimeError):
    """A collective across processes failed: a peer process died or the transport broke."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective across processes did not complete within the collective timeout."""


class CollectiveMismatchError(CollectiveError):
    """Processes entered different collectives, or the same one on different tensors
    (found by the debug checks, ``shardwise.config.set_debug_checks(True)``)."""


class ConcurrentCollectiveError(CollectiveError):
    """A second thread of a process entered a collective across processes while another thread
    of the same process was inside one (they run one at a time, in one order)."""


class NotEagerError(ShardwiseError, RuntimeError):
    """A TF DTensor call that moves per-device components (``pack``, ``unpack``,
    ``fetch_layout``) was made while ``torch.compile`` or a tracer was building a graph."""


class DistributeContextError(ShardwiseError, RuntimeError):
    """A tf.distribute method called in the wrong context (replica vs cross-replica), or with
    a different strategy current (TF raises RuntimeError)."""


class DistributeValueError(ShardwiseError, ValueError):
    """A tf.distribute argument with a wrong value: a reduction that is not defined, an update
    without aggregation, an empty device list (TF raises ValueError)."""


class DistributeAttributeError(ShardwiseError, AttributeError):
    """A Python number 0 reduced over several replicas (TF 2.21's shortcut for zeros reads
    ``value.shape`` and raises AttributeError)."""


class DistributeTypeError(ShardwiseError, TypeError):
    """A tf.distribute argument of the wrong kind: per-replica values where mirrored ones are
    needed, a VariableAggregation where a ReduceOp is needed (TF raises TypeError)."""


class ReplicaSyncError(ShardwiseError, RuntimeError):
    """Replica threads did not meet at a merge point: one made a different number of
    ``merge_call`` calls, or did not reach it within the replica timeout."""


class ParallelPlanError(ShardwiseError, ValueError):
    """A parallelize plan entry matches no module or parameter, or its sizes do not divide
    over the mesh dim it shards (attention heads, vocabulary)."""


class ParallelStyleError(ParallelPlanError, TypeError):
    """A parallel style applied to a module type it cannot shard."""


class CheckpointMismatchError(ShardwiseError, ValueError):
    """A checkpoint does not fit the state it is loaded into: missing or unexpected keys,
    different shapes or dtypes (nothing is loaded)."""


class CheckpointCorruptError(ShardwiseError, ValueError):
    """A checkpoint's files are missing, truncated or damaged, or belong to another checkpoint
    (their bytes differ from the digests recorded at save); nothing is loaded."""


class UnsafeCheckpointError(ShardwiseError, ValueError):
    """A checkpoint holds something loading it could run (a pickled global outside the
    allow-list of plain data) or names a file outside its directory; nothing is loaded."""


class DeferredInitError(ShardwiseError, RuntimeError):
    """A module built on the meta device cannot be materialized (no ``reset_parameters``...)."""


class DataParallelError(ShardwiseError, ValueError):
    """``replicate``/``fully_shard`` got a mesh, module or parameter placements they cannot
    combine (a data-parallel dim already sharded, tensors on another mesh...)."""


class StrategyValidationError(ShardwiseError, AssertionError):
    """A sharding strategy, forced on sample inputs, gave a value or placements that differ
    from single-device PyTorch (``shardwise.rules.validate_strategy``)."""


class StateDictMismatchError(ShardwiseError, RuntimeError):
    """``Module.load_state_dict`` got an entry that does not fit a DTensor parameter or buffer
    (other global shape or mesh, a plain tensor for a DTensor or the reverse); nothing is
    loaded. A RuntimeError, as torch's own load errors are."""


class LabelOutOfRangeError(ShardwiseError, IndexError):
    """A class-index label (``loss_parallel``'s cross entropy) outside ``[0, classes)`` and
    not ``ignore_index``: an IndexError, as torch's own cross entropy raises."""


class CheckpointNotFoundError(ShardwiseError, FileNotFoundError):
    """``shardwise.checkpoint.load`` got a path that does not exist, or a directory with no
    checkpoint file in it (no save ever finished there)."""


class CheckpointPathError(ShardwiseError, FileExistsError):
    """``shardwise.checkpoint.save`` got a path holding something it did not write (a file, a
    link, a directory of other files): it refuses it rather than replace it; nothing is
    written or deleted."""


class ProcessStateError(ShardwiseError, RuntimeError):
    """A rank thread of the launcher's threads mode tried to change state its process holds
    once for every rank (the working directory, torch's default dtype...)."""


class CheckpointFileMissingError(CheckpointCorruptError, FileNotFoundError):
    """A checkpoint's directory lacks one of its files (``.metadata``, a data file): corrupt,
    and also a FileNotFoundError."""


class ShardwiseWarning(UserWarning):
    """Base class of the warnings shardwise gives."""


class CommBudgetWarning(ShardwiseWarning):
    """Communication went past a limit of ``comm_budget(..., on_exceed="warn")``."""


__all__ = [
    "CheckpointCorruptError",
    "CheckpointFileMissingError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommBudgetExceededError",
    "CommBudgetWarning",
    "ConcurrentCollectiveError",
    "DataParallelError",
    "DeferredInitError",
    "DistributeAttributeError",
    "DistributeContextError",
    "DistributeTypeError",
    "DistributeValueError",
    "DTensorAsLocalError",
    "DTensorCollectiveError",
    "ImplicitRedistributeError",
    "InvalidArgumentError",
    "InvalidPlacementError",
    "LabelOutOfRangeError",
    "LayoutError",
    "LocalComponentsError",
    "LocalShapeError",
    "MeshError",
    "NonLeafTensorError",
    "NotEagerError",
    "OpArgumentError",
    "PackError",
    "ParallelPlanError",
    "ParallelStyleError",
    "ProcessStateError",
    "ReplicaSyncError",
    "ShardwiseError",
    "ShardwiseTypeError",
    "ShardwiseWarning",
    "StateDictMismatchError",
    "StrategyValidationError",
    "UnsafeCheckpointError",
    "UnsupportedOpError",
    "VariableInputError",
]
