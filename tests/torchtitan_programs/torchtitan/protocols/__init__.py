"""Stand-in for torchtitan's ``protocols/__init__.py``: only the model protocol is needed (the
real one also imports model converters and state-dict adapters)."""

from .model import BaseModelArgs, ModelProtocol

__all__ = ["BaseModelArgs", "ModelProtocol"]
