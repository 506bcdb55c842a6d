"""Stand-in for torchtitan's ``tools/utils.py``. The CPU substitution lives here: torchtitan
picks ``_get_available_device_type() or "cuda"`` (so "cuda" on a machine without GPUs); these
runs build their meshes on CPU over gloo."""

import torch

device_type, device_module = "cpu", torch.cpu
