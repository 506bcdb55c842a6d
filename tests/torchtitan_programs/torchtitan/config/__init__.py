"""Stand-in for torchtitan's ``config/__init__.py``: the same ``TORCH_DTYPE_MAP`` and the
verbatim ``job_config`` classes, without the ``ConfigManager`` (tyro command-line parsing)."""

import torch

from .job_config import JobConfig

TORCH_DTYPE_MAP = {
    "float16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}

__all__ = ["JobConfig", "TORCH_DTYPE_MAP"]
