"""Stand-in for torchtitan's ``distributed/context_parallel.py``: the test runs with cp = 1,
so ``parallelize_llama`` never calls it."""


def apply_cp_to_attention_module(*args, **kwargs):
    raise NotImplementedError("context parallelism is not part of these copies")
