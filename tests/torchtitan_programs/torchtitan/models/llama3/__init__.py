"""Stand-in for torchtitan's ``models/llama3/__init__.py``, which builds the trainer's
``TrainSpec`` (data loaders, tokenizers, optimizers, pipelining). Like the real one it imports
the attention module first (there through the trainer's components): that import registers
``torch.ops.torch_attn._varlen_attn``, which ``infra/parallelize.py`` names at import."""

from torchtitan.models import attention  # noqa: F401
