"""The call-site helper: library code is declared by package (``settings.LIBRARY_PACKAGES``),
not guessed from file paths."""

from __future__ import annotations

import inspect
import types

import torch

import shardwise as sw
from shardwise import settings
from shardwise.call_site import call_site


def _module_calling(name: str, source: str) -> types.ModuleType:
    """A module named ``name`` (its file anywhere) whose ``make`` runs ``source``."""
    module = types.ModuleType(name)
    exec(compile(f"def make():\n    return {source}\n", "/anywhere/make.py", "exec"),
         module.__dict__)
    return module


def test_factory_calls_of_a_declared_library_stay_plain_under_default_mesh() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    library = _module_calling("mylib.layers", "torch.ones(3)")
    library.torch = torch
    with sw.tf.default_mesh(mesh):
        assert isinstance(library.make(), sw.DTensor)  # undeclared: the program's own call
        with settings.LIBRARY_PACKAGES.override((*settings.LIBRARY_PACKAGES.get(), "mylib")):
            made = library.make()
            assert type(made) is torch.Tensor and made.tolist() == [1.0, 1.0, 1.0]
            assert isinstance(torch.ones(3), sw.DTensor)  # this test's own call still is one


def test_call_site_is_the_first_frame_outside_the_declared_packages() -> None:
    here, line = call_site(), inspect.currentframe().f_lineno
    assert here == f"{__file__}:{line}"
    library = _module_calling("mylib.helpers", "call_site()")
    library.call_site = call_site
    assert library.make() == "/anywhere/make.py:2"  # mylib undeclared: its frame is the site
    with settings.LIBRARY_PACKAGES.override(("torch", "shardwise", "mylib")):
        assert "test_call_site.py:" in library.make()
