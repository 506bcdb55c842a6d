"""A training checkpoint's ``extra`` values as data: a JSON tree for the structure and DCP
tensor entries for the tensors, so they load back exactly and loading them runs no code.

Supported, nested in any way: None, bool, int, float, str, bytes, list, tuple, dict (keys of
those scalar types or tuples of them) and tensors (back as plain CPU tensors, a DTensor as a
plain tensor of its full value). Anything else is refused at save, naming where it is.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from ..dtensor import DTensor
from ..errors import CheckpointCorruptError, ShardwiseTypeError

_SUPPORTED = ("None, bool, int, float, str, bytes, lists, tuples, dicts and tensors (nothing "
              "that needs pickling to load)")


def encode(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """The JSON tree of ``value`` and its tensors, in the order the tree numbers them;
    ``ShardwiseTypeError`` naming the first unsupported value."""
    tensors: list[torch.Tensor] = []
    return _encode(value, "extra", tensors, set()), tensors


def _encode(value: Any, where: str, tensors: list | None, open_ids: set[int]) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if kind is torch.Tensor or isinstance(value, DTensor):
        if tensors is None:
            raise ShardwiseTypeError(f"{where} is a tensor used as a dict key: a checkpoint's "
                                     f"extra cannot hold it; nothing was saved")
        tensors.append(value.detach())
        return {"tensor": len(tensors) - 1, "requires_grad": value.requires_grad}
    if kind in (list, tuple, dict):
        if id(value) in open_ids:
            raise ShardwiseTypeError(f"{where} contains itself: a checkpoint's extra cannot "
                                     f"hold it; nothing was saved")
        open_ids.add(id(value))
        if kind is dict:
            out: Any = {"dict": [
                [_encode(k, f"{where} key {k!r}", None, open_ids),
                 _encode(v, f"{where}[{k!r}]", tensors, open_ids)]
                for k, v in value.items()
            ]}
        else:
            out = {kind.__name__: [_encode(v, f"{where}[{i}]", tensors, open_ids)
                                   for i, v in enumerate(value)]}
        open_ids.discard(id(value))
        return out
    raise ShardwiseTypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: a checkpoint's extra holds only "
        f"{_SUPPORTED}; nothing was saved"
    )


def decode(node: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The value ``encode`` gave ``node`` for, with its tensors taken from ``tensors``."""
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is dict:
        if set(node) == {"tensor", "requires_grad"} and node["tensor"] in tensors:
            tensor = tensors[node["tensor"]]
            return tensor.requires_grad_() if node["requires_grad"] is True else tensor
        if len(node) == 1:
            (tag, body), = node.items()
            if tag == "bytes" and type(body) is str:
                return base64.b64decode(body)
            if tag in ("list", "tuple") and type(body) is list:
                items = [decode(v, tensors) for v in body]
                return items if tag == "list" else tuple(items)
            if tag == "dict" and type(body) is list and all(
                type(kv) is list and len(kv) == 2 for kv in body
            ):
                return {decode(k, tensors): decode(v, tensors) for k, v in body}
    raise CheckpointCorruptError(f"the checkpoint's extra holds {str(node)[:80]!r}, which "
                                 f"shardwise.checkpoint.save does not write")
