"""Stand-in for torchtitan's ``distributed/activation_checkpoint.py``: the test runs with
``activation_checkpoint.mode = "none"``, so ``parallelize_llama`` never calls it."""


def apply_ac(*args, **kwargs):
    raise NotImplementedError("activation checkpointing is not part of these copies")
