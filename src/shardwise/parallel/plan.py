"""Which modules and parameters a plan entry names: fully qualified names, globs
(``"layers.*.attn"``: ``*`` matches within one name component) and regular expressions
(``re.compile(...)`` or a ``"re:"`` prefix; veScale's plans write every key as one), always
matched against the whole name."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from torch import nn

from ..errors import ParallelPlanError

PlanKey = str | re.Pattern

_GLOB_CHARS = frozenset("*?[")


def key_text(key: PlanKey) -> str:
    """The plan key as written, for error messages."""
    return f"re.compile(r'{key.pattern}')" if isinstance(key, re.Pattern) else f"'{key}'"


def name_matcher(key: PlanKey, *, regex: bool = False):
    """A predicate on full names for ``key`` (``regex``: plain strings are regular
    expressions, veScale's convention)."""
    if isinstance(key, re.Pattern):
        return lambda name: key.fullmatch(name) is not None
    if not isinstance(key, str):
        raise ParallelPlanError(
            f"plan key {key!r} must be a module name, a glob, a 're:' string or a compiled regex"
        )
    if regex or key.startswith("re:"):
        try:
            pattern = re.compile(key[3:] if key.startswith("re:") else key)
        except re.error as exc:
            raise ParallelPlanError(
                f"plan key {key!r} is not a valid regular expression: {exc}"
            ) from exc
        return lambda name: pattern.fullmatch(name) is not None
    if _GLOB_CHARS & set(key):
        parts = key.split(".")

        def glob(name: str) -> bool:  # never the root module (name "")
            atoms = name.split(".")
            return (
                bool(name)
                and len(atoms) == len(parts)
                and all(fnmatch.fnmatchcase(a, p) for a, p in zip(atoms, parts, strict=True))
            )

        return glob
    return lambda name: name == key


def match_modules(
    root: nn.Module, key: PlanKey, *, regex: bool = False
) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs of ``root`` that ``key`` names, in module order; a plan key
    that names nothing is an error listing some of the names there are."""
    matches = name_matcher(key, regex=regex)
    found = [(n, m) for n, m in root.named_modules() if matches(n)]
    if not found:
        raise unmatched("module", key, root, (n for n, _ in root.named_modules() if n))
    return found


def _sample(names: Iterable[str], limit: int = 12) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)} in all)"


def unmatched(
    kind: str, key: PlanKey, root: nn.Module, candidates: Iterable[str]
) -> ParallelPlanError:
    """The error for a plan key that names no ``kind`` (parameter, module input...)."""
    return ParallelPlanError(
        f"plan entry {key_text(key)} matches no {kind} of {type(root).__name__}; they are "
        f"{_sample(candidates)}"
    )
