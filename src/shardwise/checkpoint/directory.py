"""Where a save writes and what it may remove: only what a shardwise save wrote.

A save writes into a fresh directory ``<path>.saving-<random>`` (``mkdtemp``: it cannot be
anyone else's; the file ``MARKER`` in it says a shardwise save made it) and, once complete,
exchanges it with ``path`` in one step (``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere
two renames, between which ``interrupted`` finds the previous checkpoint). ``path`` must be
absent, an empty directory, or a checkpoint a shardwise save wrote holding nothing else; any
other is refused with ``CheckpointPathError`` before anything is written. The replaced
checkpoint's files are then removed by name (those its record lists) and nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from ..errors import CheckpointPathError, ShardwiseWarning
from .storage import METADATA, RECORD

MARKER = ".shardwise-save"
SAVING = ".saving-"
_MARK = "a directory made by shardwise.checkpoint.save\n"
_OLD = "-old"  # the previous checkpoint's name between the two renames of the fallback


def written_files(directory: Path) -> frozenset[str] | None:
    """The names of the files the save that wrote ``directory`` put there (its record's
    ``files``; for records without them, ``.metadata``, the record and the data files it
    lists), or None when ``directory`` holds no record a shardwise save wrote."""
    try:
        record = json.loads((directory / RECORD).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if type(record) is not dict or record.get("format") != "shardwise.checkpoint/1":
        return None
    files, items = record.get("files"), record.get("items")
    if type(files) is list and all(type(f) is str and os.sep not in f for f in files):
        return frozenset(files) | {RECORD}
    if type(items) is dict:
        return frozenset(n for n in items if type(n) is str and os.sep not in n) | {
            METADATA, RECORD}
    return None


def check_target(path: Path, outcome: str = "nothing was written or deleted") -> frozenset[str]:
    """The names of the files in ``path`` that replacing it may remove (none when ``path`` is
    absent or an empty directory); ``CheckpointPathError`` (ending with ``outcome``) when
    ``path`` holds anything a shardwise save did not write there."""
    if not os.path.lexists(path):
        return frozenset()
    if path.is_symlink() or not path.is_dir():
        kind = "a symbolic link" if path.is_symlink() else "not a directory"
        raise CheckpointPathError(
            f"cannot save a checkpoint to {str(path)!r}: it is {kind}; save writes a new "
            f"directory, an empty one, or over a checkpoint it wrote; {outcome}"
        )
    entries = set(os.listdir(path))
    if not entries:
        return frozenset()
    owned = written_files(path)
    if owned is None:
        shown = ", ".join(sorted(entries)[:8]) + (", ..." if len(entries) > 8 else "")
        raise CheckpointPathError(
            f"cannot save a checkpoint to {str(path)!r}: it is a directory that "
            f"shardwise.checkpoint.save did not write (it holds {shown}); saving there would "
            f"replace the files in it. Save to a new path or an empty directory; {outcome}"
        )
    foreign = sorted(entries - owned)
    if foreign:
        raise CheckpointPathError(
            f"cannot save a checkpoint to {str(path)!r}: the checkpoint there also holds "
            f"{foreign}, which its save did not write; replacing it would delete them. Move "
            f"them out or save to another path; {outcome}"
        )
    return owned


def new_saving_dir(path: Path) -> Path:
    """A new empty directory ``<path>.saving-<random>`` beside ``path`` (holding ``MARKER``)
    for a save to ``path``, which must be fit for it (``check_target``). First the previous
    checkpoint goes back to ``path`` if a save was killed between its two renames, and the
    directories that saves of ``path`` killed part-way left are removed."""
    previous = interrupted(path)
    if previous is not None and not os.path.lexists(path):
        os.rename(previous, path)
    check_target(path)
    for stale in path.parent.glob(f"{glob.escape(path.name)}{SAVING}*"):
        if _made_here(stale):
            shutil.rmtree(stale, ignore_errors=True)
    saving = Path(tempfile.mkdtemp(prefix=path.name + SAVING, dir=path.parent))
    (saving / MARKER).write_text(_MARK)
    return saving


def _made_here(directory: Path) -> bool:
    """Whether ``directory`` is one ``new_saving_dir`` made (and not a link to elsewhere)."""
    try:
        return (not directory.is_symlink() and directory.is_dir()
                and (directory / MARKER).read_text() == _MARK)
    except OSError:
        return False


def replace(path: Path, saving: Path) -> None:
    """Put the complete checkpoint ``saving`` at ``path``; the checkpoint it replaces loses
    the files its save wrote, and only those."""
    # again: files may have come while the save ran
    owned = check_target(path, f"nothing was deleted; the new checkpoint is in {str(saving)!r}")
    if not os.path.lexists(path):
        os.rename(saving, path)
        return
    if _exchange(saving, path):
        old = saving
    else:
        old = saving.with_name(saving.name + _OLD)
        os.rename(path, old)
        os.rename(saving, path)
    for name in owned | {MARKER}:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old / name)
    try:
        os.rmdir(old)
    except OSError:
        warnings.warn(
            f"{str(old)!r}: the replaced checkpoint's directory keeps {sorted(os.listdir(old))}, "
            f"which its save did not write; they were left there", ShardwiseWarning,
            stacklevel=3)


def interrupted(path: Path) -> Path | None:
    """The previous checkpoint of ``path`` when a save was killed between the two renames of
    the fallback (``path`` missing), or None."""
    found = [d for d in path.parent.glob(f"{glob.escape(path.name)}{SAVING}*{_OLD}")
             if _made_here(d) and written_files(d) is not None]
    return max(found, key=lambda d: d.stat().st_mtime, default=None)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` atomically; False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not on this file system
        return False
    raise OSError(err, os.strerror(err), str(b))
