"""tf.distribute's enums: how values are reduced across replicas, and how variables sync."""

from __future__ import annotations

import enum

from ..errors import DistributeTypeError, DistributeValueError


class VariableSynchronization(enum.IntEnum):
    """When a distributed variable's copies are synchronized (TF's numeric values)."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.IntEnum):
    """How replica-context updates of a variable are combined (TF's numeric values)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


class ReduceOp(enum.Enum):
    """A reduction across replicas: SUM or MEAN (``Partial("sum")`` / ``Partial("avg")``)."""

    SUM = "SUM"
    MEAN = "MEAN"

    @property
    def partial_op(self) -> str:
        """The shardwise ``Partial`` / collective reduce op of this reduction."""
        return "sum" if self is ReduceOp.SUM else "avg"

    @staticmethod
    def from_variable_aggregation(aggregation: VariableAggregation) -> ReduceOp:
        """SUM -> SUM, MEAN -> MEAN; NONE and ONLY_FIRST_REPLICA are not reductions."""
        if aggregation == VariableAggregation.SUM:
            return ReduceOp.SUM
        if aggregation == VariableAggregation.MEAN:
            return ReduceOp.MEAN
        raise DistributeValueError(
            f"VariableAggregation {aggregation!r} is not a reduction; only SUM and MEAN map to a "
            f"ReduceOp"
        )

    @staticmethod
    def resolve(value: ReduceOp | str) -> ReduceOp:
        """A ReduceOp from a ReduceOp or a case-insensitive ``"sum"``/``"mean"``."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, VariableAggregation):
            raise DistributeTypeError(
                f"expected a ReduceOp, got {value!r}; use ReduceOp.from_variable_aggregation"
            )
        if isinstance(value, str) and value.upper() in ("SUM", "MEAN"):
            return ReduceOp[value.upper()]
        raise DistributeValueError(
            f"{value!r} is not a valid ReduceOp; use ReduceOp.SUM, ReduceOp.MEAN, 'sum' or 'mean'"
        )


def check_synchronization(value: object) -> VariableSynchronization:
    try:
        return VariableSynchronization(value)
    except ValueError:
        raise DistributeValueError(
            f"invalid variable synchronization {value!r}; use a VariableSynchronization"
        ) from None


def check_aggregation(value: object) -> VariableAggregation:
    try:
        return VariableAggregation(value)
    except ValueError:
        raise DistributeValueError(
            f"invalid variable aggregation {value!r}; use a VariableAggregation"
        ) from None
