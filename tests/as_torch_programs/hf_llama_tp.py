"""A tiny Llama (or Mixtral, MoE: its experts' ``packed_colwise`` plan) trained with Hugging Face
transformers' own tensor parallelism (``from_pretrained(..., tp_plan="auto")``): ``setup FOLDER
[MODEL]`` saves a checkpoint and the losses of the same training on one device; ``rank FOLDER TAG
[MODEL]`` (one rank of a launch) loads the checkpoint sharded, trains, and writes its losses and
parameter classes to ``FOLDER/TAG_rank<r>.json``. MODEL is ``llama`` (the default) or
``mixtral``. Needs transformers and accelerate (never shardwise's deps)."""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

STEPS = 3


SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
             tie_word_embeddings=False)


def model_class(model: str = "llama") -> tuple[type, object]:
    """The causal LM class of ``model`` and its tiny config."""
    if model == "mixtral":
        return MixtralForCausalLM, MixtralConfig(**SIZES, num_local_experts=4,
                                                 num_experts_per_tok=2)
    return LlamaForCausalLM, LlamaConfig(**SIZES)


def train(model: torch.nn.Module) -> list[float]:
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(mode: str, folder: str, *rest: str) -> None:
    ckpt = os.path.join(folder, "ckpt")
    if mode == "setup":
        cls, config = model_class(*rest)
        torch.manual_seed(0)
        cls(config).save_pretrained(ckpt)
        model = cls.from_pretrained(ckpt, dtype=torch.float32)
        with open(os.path.join(folder, "reference.json"), "w") as f:
            json.dump({"losses": train(model)}, f)
        return
    tag, *model_name = rest
    cls, _ = model_class(*model_name)
    model = cls.from_pretrained(ckpt, tp_plan="auto", dtype=torch.float32)
    classes = sorted({f"{type(p).__module__}.{type(p).__name__}" for p in model.parameters()})
    with open(os.path.join(folder, f"{tag}_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"losses": train(model), "classes": classes}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
