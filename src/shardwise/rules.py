"""Teaching shardwise an op: the sharding-rule API (PyTorch's op strategies and propagation
rules, ``register_sharding``), the hooks around an op's local run, the strategy validator and
the sharding-decision cache. Importing it loads the op layer. docs/extending.md shows each."""

from __future__ import annotations

from . import dispatch as _dispatch  # noqa: F401  (the op layer: handler and rules)
from .custom_sharding import register_sharding
from .dispatch import clear_sharding_cache
from .ops.common import DimOption, product_strategy
from .ops.registry import (
    OpSchema,
    OpStrategy,
    OutputSharding,
    PlacementStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    bypass_sharding_propagation,
    register_local_args,
    register_op_strategy,
    register_post_patch,
    register_pre_patch,
    register_prop_rule,
    remove_hooks,
)
from .ops.validate import ValidationReport, validate_strategy

__all__ = [
    "DimOption",
    "OpSchema",
    "OpStrategy",
    "OutputSharding",
    "PlacementStrategy",
    "RuntimeSchemaInfo",
    "ValidationReport",
    "bypass_dispatch",
    "bypass_sharding_propagation",
    "clear_sharding_cache",
    "product_strategy",
    "register_local_args",
    "register_op_strategy",
    "register_post_patch",
    "register_pre_patch",
    "register_prop_rule",
    "register_sharding",
    "remove_hooks",
    "validate_strategy",
]
