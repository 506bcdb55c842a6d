"""Reading DCP's ``.metadata`` without running code from it, and checking what it describes.

DCP pickles its ``Metadata``; ``pickle.load`` would call any global a crafted file names. Here
the unpickler resolves only an allow-list of classes (DCP's metadata dataclasses, ``torch.Size``,
dtypes, layouts, paths) and refuses every other global with ``UnsafeCheckpointError``. The result
is then checked field by field: the keys, shapes and chunks are well formed and every data file
it names is a plain file name inside the checkpoint directory.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import CheckpointCorruptError, UnsafeCheckpointError
from ..torch_compat import StorageInfo

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._file = file

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                 torch.dtype)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{str(self._file)!r} names the global {module}.{name}, which is not one of DCP's "
            f"metadata classes: loading it could run code, so nothing was loaded"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"{str(self._file)!r} holds a persistent id {pid!r}: not DCP metadata")


def unpickle_metadata(data: bytes, file: Path) -> Metadata:
    """The ``Metadata`` pickled in ``data`` (the bytes of ``file``), with only allow-listed
    globals resolved; ``UnsafeCheckpointError`` for any other, ``CheckpointCorruptError`` for
    bytes that are no valid pickle of DCP metadata."""
    try:
        metadata = _Unpickler(data, file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or damaged pickle (any of pickle's many errors)
        raise CheckpointCorruptError(
            f"{str(file)!r} is not a readable DCP metadata file ({type(exc).__name__}: {exc})"
        ) from None
    if type(metadata) is not Metadata:
        raise CheckpointCorruptError(
            f"{str(file)!r} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _ints(value: Any, ndim: int | None = None) -> bool:
    return (
        isinstance(value, torch.Size | tuple | list)
        and all(type(v) is int and v >= 0 for v in value)
        and (ndim is None or len(value) == ndim)
    )


def data_file(directory: Path, name: Any, *, what: str) -> Path:
    """``directory / name`` for a data file ``name`` that metadata names: a plain file name
    whose real path (symlinks followed) stays inside ``directory``; ``UnsafeCheckpointError``
    otherwise."""
    if (
        type(name) is not str
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or Path(name).is_absolute()
    ):
        raise UnsafeCheckpointError(
            f"{what} names the data file {name!r}, a path outside the checkpoint directory "
            f"{str(directory)!r} (only file names inside it are read): nothing was loaded"
        )
    path = directory / name
    real, root = path.resolve(), directory.resolve()
    if real.parent != root:
        raise UnsafeCheckpointError(
            f"{what} names the data file {name!r}, a link to {str(real)!r} outside the "
            f"checkpoint directory {str(root)!r}: nothing was loaded"
        )
    return path


def coverage_fault(shape: list[int], chunks: list[tuple[list[int], list[int]]]) -> str | None:
    """Why the boxes ``chunks`` ((offsets, sizes), inside ``shape``) do not tile ``shape``
    exactly (two overlap, or elements are in none: the first such box named), or None."""
    boxes = [(o, s) for o, s in chunks if math.prod(s)]
    if not math.prod(shape):
        return None
    # sweep along the dim where the boxes start at the most places
    dim = max(range(len(shape)), key=lambda d: len({o[d] for o, _ in boxes}), default=None)
    if dim is not None:
        boxes.sort(key=lambda b: b[0][dim])
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1:]:
            if dim is not None and ob[dim] >= oa[dim] + sa[dim]:
                break
            if all(b < a + m and a < b + n for a, m, b, n in zip(oa, sa, ob, sb, strict=True)):
                return (f"overlap: the chunk at offsets {oa} sizes {sa} and the one at offsets "
                        f"{ob} sizes {sb}")
    if sum(math.prod(s) for _, s in boxes) == math.prod(shape):
        return None
    return f"leave a gap: {_gap(shape, boxes)} is in no chunk (no saved value there)"


def _gap(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> str:
    """A box of ``shape`` in none of ``boxes`` (disjoint boxes that do not cover it)."""
    cuts = [sorted({0, n, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
            for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > 1_000_000:
        missing = math.prod(shape) - sum(math.prod(s) for _, s in boxes)
        return f"{missing} of its {math.prod(shape)} elements"
    cells = itertools.product(*(zip(c, c[1:], strict=False) for c in cuts))
    start, end = next(
        ([a for a, _ in cell], [b for _, b in cell]) for cell in cells
        if not any(all(o <= a < o + n for (a, _), o, n in zip(cell, ob, sb, strict=True))
                   for ob, sb in boxes)
    )
    return f"the box at offsets {start} sizes {[b - a for a, b in zip(start, end, strict=True)]}"


def check_metadata(
    metadata: Metadata, directory: Path, file: Path
) -> list[tuple[MetadataIndex, StorageInfo]]:
    """Raise unless ``metadata`` is well formed: tensor entries with a dtype, a shape and
    chunks that tile it (inside it, no gap, no overlap), byte entries, and a storage location
    (a data file inside ``directory``, a byte range, no stream transforms) for every chunk and
    byte entry; returns those locations."""

    def corrupt(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{str(file)!r}: {why}; nothing was loaded")

    entries = metadata.state_dict_metadata
    storage = metadata.storage_data
    if type(entries) is not dict or type(storage) is not dict:
        raise corrupt("no table of entries and storage locations")
    wanted: list[MetadataIndex] = []
    for key, md in entries.items():
        if type(key) is not str:
            raise corrupt(f"an entry key {key!r} is not a string")
        if type(md) is BytesStorageMetadata:
            wanted.append(MetadataIndex(key))
            continue
        if type(md) is not TensorStorageMetadata:
            raise corrupt(f"{key}: a {type(md).__name__} is neither tensor nor bytes metadata")
        properties = md.properties
        if type(properties) is not dcp_metadata.TensorProperties or not isinstance(
            properties.dtype, torch.dtype
        ):
            raise corrupt(f"{key}: no tensor dtype")
        if not _ints(md.size) or type(md.chunks) is not list:
            raise corrupt(f"{key}: size {md.size!r} is not a shape, or no chunk list")
        for chunk in md.chunks:
            ndim = len(md.size)
            if (
                type(chunk) is not ChunkStorageMetadata
                or not _ints(chunk.offsets, ndim)
                or not _ints(chunk.sizes, ndim)
                or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, md.size,
                                                    strict=True))
            ):
                raise corrupt(f"{key}: a chunk that is not a box of shape {list(md.size)}")
            wanted.append(MetadataIndex(key, torch.Size(chunk.offsets)))
        why = coverage_fault(list(md.size), [(list(c.offsets), list(c.sizes)) for c in md.chunks])
        if why:
            raise corrupt(f"{key}: the chunks of its global shape {list(md.size)} {why}")
    inside: set[str] = set()
    for index in wanted:
        info = storage.get(index)
        if type(info) is not StorageInfo:
            raise corrupt(f"{index.fqn}: no storage location for offset {index.offset}")
        if info.relative_path not in inside:
            data_file(directory, info.relative_path, what=f"{str(file)!r} ({index.fqn})")
            inside.add(info.relative_path)
        if type(info.offset) is not int or type(info.length) is not int or min(
            info.offset, info.length
        ) < 0:
            raise corrupt(f"{index.fqn}: the byte range {info.offset!r}+{info.length!r}")
        if info.transform_descriptors:
            raise corrupt(
                f"{index.fqn}: stream transforms {list(info.transform_descriptors)!r} "
                f"(shardwise.checkpoint writes none)"
            )
    return [(index, storage[index]) for index in wanted]

