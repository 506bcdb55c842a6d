"""torchtitan's Llama 3, trained as torchtitan's trainer does it, one rank of a dp x tp world.

Written against ``torch.distributed.tensor`` like the torchtitan copies beside it;
``titan_harness.py`` ports the whole folder to shardwise by rewriting imports. ``train_rank()``
follows torchtitan's ``train.py``: the model built on the meta device, ``parallelize_llama``
(``apply_tp`` on ``mesh["tp"]``, ``apply_fsdp`` on ``mesh["fsdp"]``), ``to_empty`` and
``init_weights``; each step a sum-reduced cross-entropy under ``loss_parallel`` divided by the
global token count (torchtitan turns FSDP's gradient division off), each dp rank on its own
rows of the global batch. For a fair comparison the sharded model then takes the weights
``initial_state()`` gives a plain model (torchtitan's own ``init_weights`` after one seed).
``train_reference()`` trains that plain model on the global batch on one device. Not
torchtitan's: gradient clipping and the learning-rate schedule (both off), and the data (random
tokens).

``python -m shardwise.launch --nproc 4 train_llama.py`` (after the port) prints every rank's
losses; ``python train_llama.py`` prints the single-device reference.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3.infra.parallelize import parallelize_llama
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

VOCAB, SEQ, ROWS, STEPS, LR, SEED = 64, 16, 4, 3, 1e-2, 0
TP = 2


def job_config(tp: int = TP) -> JobConfig:
    """torchtitan's defaults but tiny, float32 and without activation checkpointing."""
    job = JobConfig()
    job.training.seq_len = SEQ
    job.training.mixed_precision_param = "float32"
    job.activation_checkpoint.mode = "none"
    job.parallelism.tensor_parallel_degree = tp
    return job


def model_args(job: JobConfig) -> TransformerModelArgs:
    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB)
    args.update_from_config(job)
    return args


def initial_state() -> dict[str, torch.Tensor]:
    """torchtitan's init of a plain model after ``manual_seed(SEED)``: the common start."""
    torch.manual_seed(SEED)
    model = Transformer(model_args(job_config()))
    with torch.no_grad():
        model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def data() -> torch.Tensor:
    """Token ids of every step's global batch: (STEPS, ROWS, SEQ + 1)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, VOCAB, (STEPS, ROWS, SEQ + 1), generator=g)


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train_reference() -> dict:
    """The plain model trained on the global batch on one device."""
    model = Transformer(model_args(job_config()))
    model.load_state_dict(initial_state())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in data():
        optimizer.zero_grad()
        inputs, labels = batch[:, :-1], batch[:, 1:]
        loss = cross_entropy_loss(model(inputs), labels) / float((labels != IGNORE_INDEX).sum())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: _value(p) for k, p in model.named_parameters()}}


def train_rank(tp: int = TP) -> dict:
    """One rank: its dp rank, its losses (its rows' summed loss / global tokens; their sum
    over dp is the global mean) and the final full parameters."""
    if not dist.is_initialized():  # torchtitan's trainer initializes it (gloo here: CPU)
        dist.init_process_group("gloo")
    # torchtitan's set_determinism with debug.seed set: the same seed on every rank
    torch.manual_seed(SEED)
    job = job_config(tp)
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, etp=1,
        world_size=dist.get_world_size(),
    )
    with torch.device("meta"):
        model = Transformer(model_args(job))
    model = parallelize_llama(model, parallel_dims, job)
    for m in model.modules():  # gloo has no PREMUL_SUM, which torch's FSDP2 reduces with once
        # apply_fsdp sets gradient_divide_factor=1.0; its plain SUM divided by 1 is the same
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model.train()
    state = initial_state()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(state[name], p.device_mesh, p.placements))

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch_mesh = parallel_dims.get_mesh("batch")
    dp_rank, dp_size = batch_mesh.get_local_rank(), batch_mesh.size()
    rows = ROWS // dp_size
    losses = []
    for batch in data():
        optimizer.zero_grad()
        global_valid_tokens = float((batch[:, 1:] != IGNORE_INDEX).sum())
        local = batch[dp_rank * rows : (dp_rank + 1) * rows]
        inputs, labels = local[:, :-1], local[:, 1:]
        with loss_parallel():
            pred = model(inputs)
            loss = cross_entropy_loss(pred, labels) / global_valid_tokens
            del pred
            loss.backward()
        optimizer.step()
        losses.append(_value(loss).item())
    params = {k: _value(p) for k, p in model.named_parameters()}
    return {"dp_rank": dp_rank, "losses": losses, "params": params}


if __name__ == "__main__":
    if "WORLD_SIZE" not in os.environ:
        print("reference", " ".join(f"{v:.7g}" for v in train_reference()["losses"]))
    else:
        result = train_rank()
        print(f"rank {dist.get_rank()} dp {result['dp_rank']}",
              " ".join(f"{v:.7g}" for v in result["losses"]), flush=True)
        dist.destroy_process_group()
