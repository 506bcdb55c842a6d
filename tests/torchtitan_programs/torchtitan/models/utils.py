"""Stand-in for torchtitan's ``models/utils.py``, whose other helpers import checkpoint
adapters: the model needs only ``trunc_normal_``, written here to torchtitan's contract (draw in
float32 whatever the tensor's dtype, then copy in) so the initial weights are the same."""

import torch
import torch.nn as nn


def get_dense_model_nparams_and_flops(*args, **kwargs):
    raise NotImplementedError("FLOP accounting is not part of this program")


def trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0
) -> None:
    """``nn.init.trunc_normal_`` drawn on a float32 copy of ``tensor``, written back."""
    draw = tensor.float()
    nn.init.trunc_normal_(draw, mean=mean, std=std, a=a, b=b)
    tensor.copy_(draw)
