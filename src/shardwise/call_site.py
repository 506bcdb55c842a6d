"""Where a call comes from: the first frame of the program's own code, for the call site that
logs and collective errors name, and for the torch factory calls ``default_mesh`` turns into
DTensors. Library code is declared, not guessed: the frames of the top-level packages in
``settings.LIBRARY_PACKAGES`` (torch and shardwise unless extended) are the library's."""

from __future__ import annotations

import sys
from types import FrameType

from . import settings


def is_library(frame: FrameType) -> bool:
    """Whether ``frame`` runs code of a package declared in ``settings.LIBRARY_PACKAGES`` (or
    the interpreter's import machinery)."""
    module = frame.f_globals.get("__name__") or ""
    top = module.partition(".")[0]
    return top in settings.LIBRARY_PACKAGES.get() or top in ("importlib", "contextlib")


def called_by_library(depth: int) -> bool:
    """Whether the caller ``depth`` frames above the function calling this one is library
    code (``depth=1``: that function's own caller)."""
    return is_library(sys._getframe(depth + 1))


def call_site() -> str:
    """``file:line`` of the innermost frame of the program's own code (``<unknown>`` if
    none)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if not is_library(frame):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
