"""pytest plugin for ``tools/run_torch_tests.py``: runs PyTorch's own DTensor test files on torch or
through shardwise's drop-in switch, with torch's harness.

- ``SHARDWISE_AS_TORCH=1``: the switch goes on here, before pytest imports a test module.
- ``SHARDWISE_TT_FORK=1``: torch's ``MultiProcessTestCase`` starts its rank processes with fork
  instead of spawn (each spawned rank imports torch afresh, a minute a test on a loaded 2-core
  machine); the ranks inherit the parent's modules, the switch included. Both runs get it alike.
- torch 2.13's ``FSDPTest`` and ``FSDPTestContinuous`` (FSDP2's files) skip every test on a
  machine without an accelerator: their rank start compares ``torch.accelerator.device_count()``
  (0 on CPU) with the world size, without the CPU exception of their mixin. On CPU that one check
  is answered "enough", so the tests torch marks ``allow_cpu`` (and those without a GPU skip) run
  on gloo, alike for both runs.
"""

from __future__ import annotations

import os
import sys


def pytest_configure(config: object) -> None:
    if os.environ.get("SHARDWISE_AS_TORCH") == "1":
        from shardwise.as_torch import as_torch

        as_torch()
    if os.environ.get("SHARDWISE_TT_FORK") == "1":
        import torch.multiprocessing
        from torch.testing._internal.common_distributed import MultiProcessTestCase

        def _fork_processes(self: MultiProcessTestCase) -> None:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        MultiProcessTestCase._spawn_processes = _fork_processes
    _fsdp_tests_on_cpu()


def _fsdp_tests_on_cpu() -> None:
    import torch

    try:
        from torch.testing._internal.common_fsdp import FSDPTest, FSDPTestContinuous
    except ImportError:
        return
    if torch.accelerator.is_available():
        return
    real = torch.accelerator.device_count
    checks = {FSDPTest._run.__func__.__code__, FSDPTestContinuous._init_pg.__func__.__code__}

    def device_count() -> int:
        return 1 << 16 if sys._getframe(1).f_code in checks else real()

    torch.accelerator.device_count = device_count
