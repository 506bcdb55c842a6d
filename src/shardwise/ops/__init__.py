"""Sharding rules and strategies, one module per op family; importing registers them."""

from . import (
    along_dim,  # noqa: F401
    attention,  # noqa: F401
    batch_norm,  # noqa: F401
    complex,  # noqa: F401
    conv,  # noqa: F401
    copies,  # noqa: F401
    data_dependent,  # noqa: F401
    embedding,  # noqa: F401
    fft,  # noqa: F401
    foreach,  # noqa: F401
    indexing,  # noqa: F401
    linalg,  # noqa: F401
    losses,  # noqa: F401
    low_precision,  # noqa: F401
    matrix,  # noqa: F401
    norms,  # noqa: F401
    padding,  # noqa: F401
    pointwise,  # noqa: F401
    pooling,  # noqa: F401
    random,  # noqa: F401
    recurrent,  # noqa: F401
    reductions,  # noqa: F401
    reshape,  # noqa: F401
    scatter,  # noqa: F401
    selection,  # noqa: F401
    sorting,  # noqa: F401
    strided,  # noqa: F401
    structural,  # noqa: F401
    tensor_ops,  # noqa: F401
    views,  # noqa: F401
    whole,  # noqa: F401
)

# every family registered: the out= overloads of their strategies (ops/out_variants)
from .out_variants import register_remaining

register_remaining()
