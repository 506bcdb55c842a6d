"""Stand-in for torchtitan's ``config/__init__.py``: the same ``TORCH_DTYPE_MAP`` and
torchtitan's ``job_config`` classes (copied in beside it by ``titan_harness.py``), without the
``ConfigManager`` (tyro command-line parsing)."""

import torch

from .job_config import JobConfig

TORCH_DTYPE_MAP = {
    "float16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}

__all__ = ["JobConfig", "TORCH_DTYPE_MAP"]
