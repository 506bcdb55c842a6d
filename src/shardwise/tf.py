"""TF DTensor's API (``tf.experimental.dtensor``) under TF's names: layouts, meshes by
dimension name, pack/unpack of per-device components, relayout, the default mesh, DVariable
and the client queries. Importing it loads the op layer."""

from __future__ import annotations

from .layout import MATCH, UNSHARDED, Layout
from .tf_dtensor import (
    DVariable,
    barrier,
    call_with_layout,
    check_layout,
    client_id,
    copy_to_mesh,
    create_distributed_mesh,
    default_mesh,
    fetch_layout,
    get_default_mesh,
    is_dtensor,
    local_devices,
    num_clients,
    num_global_devices,
    num_local_devices,
    pack,
    relayout,
    relayout_like,
    unpack,
)
from .tf_mesh import Mesh, create_mesh

__all__ = [
    "DVariable",
    "Layout",
    "MATCH",
    "Mesh",
    "UNSHARDED",
    "barrier",
    "call_with_layout",
    "check_layout",
    "client_id",
    "copy_to_mesh",
    "create_distributed_mesh",
    "create_mesh",
    "default_mesh",
    "fetch_layout",
    "get_default_mesh",
    "is_dtensor",
    "local_devices",
    "num_clients",
    "num_global_devices",
    "num_local_devices",
    "pack",
    "relayout",
    "relayout_like",
    "unpack",
]
