"""FSDP2 x tensor parallelism on a small Llama-style decoder, written as a PyTorch user writes it.

One rank of ``torchrun --nproc-per-node N fsdp_tp.py`` (or ``python -m shardwise.launch --nproc
N``; N even): a 2-D mesh ("dp", "tp") with tp = 2. Tensor and sequence parallelism inside each
tp group: the embedding's output and every norm's input are split along the sequence
(``SequenceParallel``), attention and feed-forward gather it (``PrepareModuleInput``), their
projections split by column then row, reduce-scattering back to the sequence; the output layer
gathers the logits. Then FSDP2 shards every block, and the rest at the root, over "dp". Each dp
rank trains on its own token batch (the same on its tp ranks) with cross-entropy and AdamW.
The initial weights are each rank's generator's: the tp groups distribute their rank 0's, and
FSDP2 keeps each rank's dp chunk of its tp shard.

Only the public API of PyTorch's DTensor, its parallel styles and FSDP2; ``port.py`` turns this
into the shardwise program by rewriting the imports. CPU and gloo.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_llama import Config, TinyLlama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TP, STEPS, BATCH, SEQ, LR = 2, 4, 4, 16, 3e-3


def tensor_parallel(model: TinyLlama, tp_mesh) -> None:
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), Replicate()),
                                            desired_input_layouts=(Replicate(), Replicate())),
            "attention.wq": ColwiseParallel(use_local_output=False),
            "attention.wk": ColwiseParallel(use_local_output=False),
            "attention.wv": ColwiseParallel(use_local_output=False),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    cfg = Config()
    model = TinyLlama(cfg)
    tensor_parallel(model, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step * dp_size + dp_rank)
        tokens = torch.randint(cfg.vocab, (BATCH, SEQ + 1), generator=data)
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step}: dp rank 0's loss {loss.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
