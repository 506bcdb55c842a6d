"""Stand-in for torchtitan's ``protocols/train_spec.py`` (the trainer's registry of data
loaders, optimizers, schedules...): the model imports ``ModelProtocol`` from it."""

from .model import ModelProtocol

__all__ = ["ModelProtocol"]
