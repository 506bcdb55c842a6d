"""Sharding rules and strategies, one module per op family; importing registers them."""

from . import (
    foreach,  # noqa: F401
    structural,  # noqa: F401
)
