"""Rank threads import safely: a package that loads its names lazily and is not safe for two
threads racing through it (as transformers' ``_LazyModule``: ``from transformers import
LlamaForCausalLM``) gives every rank thread the name, as N processes would."""

from __future__ import annotations

import sys
from pathlib import Path

from shardwise.rank_threads import run_threads

LAZY = '''
import importlib, sys, time, types


class _Lazy(types.ModuleType):
    """Loads Thing on first use; a second thread arriving meanwhile fails (not thread-safe)."""

    loading = False

    def __getattr__(self, name):
        if name != "Thing":
            raise AttributeError(name)
        if _Lazy.loading:
            raise ImportError("lazypkg.Thing is half loaded by another thread")
        _Lazy.loading = True
        try:
            time.sleep(0.3)
            value = importlib.import_module(".thing", __name__).Thing
        finally:
            _Lazy.loading = False
        self.__dict__["Thing"] = value
        return value


sys.modules[__name__].__class__ = _Lazy
'''


def _import_thing() -> str:
    from lazypkg import Thing  # type: ignore[import-not-found]

    return Thing.__name__


def test_rank_threads_racing_through_a_lazy_package_all_get_the_name(tmp_path: Path) -> None:
    pkg = tmp_path / "lazypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(LAZY)
    (pkg / "thing.py").write_text("class Thing:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert run_threads(_import_thing, 3, timeout=60) == ["Thing"] * 3
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.split(".")[0] == "lazypkg"]:
            del sys.modules[name]
