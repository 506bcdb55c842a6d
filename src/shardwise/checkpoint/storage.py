"""DCP storage that ties a checkpoint's data to its metadata and reads nothing that can run code.

``DigestWriter`` (DCP's ``FileSystemWriter``) hashes with SHA-256 every item it wrote (a byte
range of a data file); the coordinator records those digests and the digest of ``.metadata`` in
``shardwise.json``, a JSON file beside them. ``open_checkpoint`` checks ``.metadata`` against
that record before unpickling it with an allow-list (``metadata.py``), and ``VerifiedReader``
checks each item's bytes against its digest before parsing them with torch's weights-only
loader. So a data file that is truncated, damaged or another checkpoint's is refused with
``CheckpointCorruptError`` naming it, whatever else was read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..errors import (
    CheckpointCorruptError,
    CheckpointFileMissingError,
    ShardwiseError,
    UnsafeCheckpointError,
)
from .metadata import check_metadata, data_file, unpickle_metadata

RECORD = "shardwise.json"
METADATA = ".metadata"
_FORMAT = "shardwise.checkpoint/1"
_BLOCK = 16 << 20


def _digests(path: Path, ranges: list[tuple[int, int]]) -> list[str]:
    """The SHA-256 of each (offset, length) byte range of ``path``."""
    out = []
    with open(path, "rb") as f:
        for offset, length in ranges:
            f.seek(offset)
            digest, left = hashlib.sha256(), length
            while left:
                block = f.read(min(left, _BLOCK))
                if not block:
                    break
                digest.update(block)
                left -= len(block)
            out.append(digest.hexdigest())
    return out


class DigestWriter(FileSystemWriter):
    """DCP's file-system writer that also records a SHA-256 per written item and of
    ``.metadata`` in ``shardwise.json``."""

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()
        per_file: dict[str, list[int]] = {}
        for i, result in enumerate(results):
            per_file.setdefault(result.storage_data.relative_path, []).append(i)
        digests: list[str] = [""] * len(results)
        for name, indices in per_file.items():
            infos = [results[i].storage_data for i in indices]
            ranges = [(info.offset, info.length) for info in infos]
            for i, digest in zip(indices, _digests(Path(self.path) / name, ranges), strict=True):
                digests[i] = digest
        future: Future = Future()
        future.set_result([
            dataclasses.replace(result, storage_data=(result.storage_data, digest))
            for result, digest in zip(results, digests, strict=True)
        ])
        return future

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        items: dict[str, list[list[Any]]] = {}
        plain = []
        for rank_results in results:
            plain.append([])
            for result in rank_results:
                info, digest = result.storage_data
                items.setdefault(info.relative_path, []).append([info.offset, info.length,
                                                                 digest])
                plain[-1].append(dataclasses.replace(result, storage_data=info))
        super().finish(metadata, plain)
        directory = Path(self.path)
        written = sorted(set(os.listdir(directory)) - {RECORD + ".tmp"} | {RECORD})
        record = {
            "format": _FORMAT,
            "files": written,
            "metadata_sha256": hashlib.sha256((directory / METADATA).read_bytes()).hexdigest(),
            "items": items,
        }
        tmp = directory / (RECORD + ".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / RECORD)


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint directory whose metadata was read safely and checked against its record."""

    directory: Path
    metadata: Metadata
    digests: dict[tuple[str, int, int], str]  # (data file, offset, length) -> SHA-256


def _entry(entry: Any) -> bool:
    """Whether ``entry`` is an [offset, length, digest] of the record."""
    return (type(entry) is list and len(entry) == 3 and type(entry[0]) is int
            and type(entry[1]) is int and type(entry[2]) is str)


def _read_record(directory: Path) -> tuple[dict[tuple[str, int, int], str], str]:
    """The item digests of ``shardwise.json`` and the digest it records for ``.metadata``."""
    path = data_file(directory, RECORD, what=str(directory))
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{str(directory)!r} has no {RECORD}: it was not written by this version of "
            f"shardwise.checkpoint.save (a torch.distributed.checkpoint.save checkpoint loads "
            f"with torch.distributed.checkpoint.load), or its save did not finish"
        ) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{str(path)!r} is not readable JSON ({exc})") from None
    items = record.get("items") if type(record) is dict else None
    if not (
        type(items) is dict
        and record.get("format") == _FORMAT
        and type(record.get("metadata_sha256")) is str
        and all(type(entries) is list and all(map(_entry, entries)) for entries in items.values())
    ):
        raise CheckpointCorruptError(f"{str(path)!r} is not a {_FORMAT} record")
    digests = {
        (name, offset, length): digest
        for name, entries in items.items()
        for offset, length, digest in entries
    }
    return digests, record["metadata_sha256"]


def open_checkpoint(directory: Path) -> Checkpoint:
    """Read the record and ``.metadata`` of the checkpoint in ``directory``: the metadata's
    bytes must have the recorded digest, unpickle with the allow-list, be well formed, and
    have a recorded digest for every item."""
    digests, metadata_digest = _read_record(directory)
    file = data_file(directory, METADATA, what=str(directory))
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointFileMissingError(
            f"{str(file)!r} is missing: the checkpoint in {str(directory)!r} is incomplete or "
            f"damaged; nothing was loaded"
        ) from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{str(file)!r} cannot be read ({exc})") from None
    if hashlib.sha256(data).hexdigest() != metadata_digest:
        raise CheckpointCorruptError(
            f"{str(file)!r} differs from the metadata recorded in {RECORD} (damaged, or "
            f"another checkpoint's): nothing was loaded"
        )
    metadata = unpickle_metadata(data, file)
    for index, info in check_metadata(metadata, directory, file):
        if (info.relative_path, info.offset, info.length) not in digests:
            raise CheckpointCorruptError(
                f"{str(directory / RECORD)!r} records no digest for {index.fqn} (bytes "
                f"{info.offset}..{info.offset + info.length} of {info.relative_path}): "
                f"nothing was loaded"
            )
    return Checkpoint(directory, metadata, digests)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Tensor)


def _not_plain(value: Any) -> type | None:
    """The type of the first value in ``value`` that is not plain data, or None."""
    if type(value) in (list, tuple):
        return next((t for t in map(_not_plain, value) if t is not None), None)
    if type(value) in (dict, OrderedDict):
        return next((t for t in map(_not_plain, [*value, *value.values()]) if t is not None),
                    None)
    return None if type(value) in _PLAIN else type(value)


def load_plain(stream: io.BytesIO) -> Any:
    """A value DCP saved as bytes (``torch.save``), with torch's weights-only loader, and only
    if it is plain data (numbers, strings, containers, plain tensors)."""
    try:
        value = torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _unsafe(exc) from None
    wrong = _not_plain(value)
    if wrong is not None:
        raise UnsafeCheckpointError(
            f"holds a {wrong.__module__}.{wrong.__qualname__} where plain data was saved")
    return value


def _unsafe(exc: Exception) -> UnsafeCheckpointError:
    found = re.search(r"GLOBAL (\S+)", str(exc))
    what = f"the global {found.group(1)}" if found else str(exc).strip().splitlines()[-1]
    return UnsafeCheckpointError(
        f"the pickled value names {what}, which torch's weights-only loader refuses: loading "
        f"it could run code, so nothing was loaded"
    )


class VerifiedReader(FileSystemReader):
    """DCP's file-system reader over a checked ``Checkpoint``: every item's bytes are read
    whole, checked against their digest, then parsed with the weights-only loader."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint.directory)
        self._checkpoint = checkpoint
        self._chunks = {
            MetadataIndex(key, torch.Size(chunk.offsets)): (torch.Size(chunk.sizes),
                                                            md.properties.dtype)
            for key, md in checkpoint.metadata.state_dict_metadata.items()
            for chunk in getattr(md, "chunks", ())
        }

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._checkpoint.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        storage = self._checkpoint.metadata.storage_data
        per_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for item in plan.items:
            name = storage[item.storage_index].relative_path
            per_file.setdefault(name, {}).setdefault(item.storage_index, []).append(item)
        directory = self._checkpoint.directory
        for name, per_index in per_file.items():
            path = data_file(directory, name, what=str(directory / METADATA))
            try:
                with open(path, "rb") as f:
                    for index in sorted(per_index, key=lambda i: storage[i].offset):
                        self._read_item(f, path, index, per_index[index], planner)
            except ShardwiseError as exc:
                raise type(exc)(f"{str(path)!r}: {exc}") from None
            except OSError as exc:
                raise CheckpointCorruptError(f"{str(path)!r} cannot be read ({exc})") from None
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_item(
        self, f: Any, path: Path, index: MetadataIndex, reads: list[ReadItem],
        planner: LoadPlanner,
    ) -> None:
        info = self._checkpoint.metadata.storage_data[index]
        f.seek(info.offset)
        data = f.read(info.length)
        where = f"{index.fqn} (bytes {info.offset}..{info.offset + info.length})"
        if len(data) != info.length:
            raise CheckpointCorruptError(
                f"{where}: the file ends after {info.offset + len(data)} bytes (truncated); "
                f"nothing was loaded"
            )
        recorded = self._checkpoint.digests[(info.relative_path, info.offset, info.length)]
        if hashlib.sha256(data).hexdigest() != recorded:
            raise CheckpointCorruptError(
                f"{where}: the bytes differ from the digest recorded at save (damaged, or "
                f"another checkpoint's data file); nothing was loaded"
            )
        try:
            if reads[0].type == LoadItemType.BYTE_IO:
                for read in reads:
                    planner.load_bytes(read, io.BytesIO(data))
                return
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"{where}: {_unsafe(exc)}") from None
        except UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(f"{where}: {exc}") from None
        except Exception as exc:  # torch.load's errors on bytes that are no saved tensor
            raise CheckpointCorruptError(f"{where}: not a saved value ({exc})") from None
        sizes, dtype = self._chunks[index]
        if type(tensor) is not torch.Tensor or tensor.shape != sizes or tensor.dtype != dtype:
            raise CheckpointCorruptError(
                f"{where}: holds {type(tensor).__name__} {getattr(tensor, 'dtype', '')} "
                f"{list(getattr(tensor, 'shape', []))}, the metadata says a tensor {dtype} "
                f"{list(sizes)}; nothing was loaded"
            )
        for read in reads:
            part = tensor
            for dim, (start, length) in enumerate(zip(read.storage_offsets, read.lengths,
                                                      strict=True)):
                part = part.narrow(dim, start, length)
            target = planner.resolve_tensor(read).detach()
            if target.shape != part.shape:
                raise CheckpointCorruptError(
                    f"{where}: a read of shape {list(part.shape)} into {list(target.shape)}")
            target.copy_(part)
            planner.commit_tensor(read, target)
