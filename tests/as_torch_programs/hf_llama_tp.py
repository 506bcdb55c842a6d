"""A tiny Llama trained with Hugging Face transformers' own tensor parallelism
(``from_pretrained(..., tp_plan="auto")``): ``setup FOLDER`` saves a checkpoint and the losses of
the same training on one device; ``rank FOLDER TAG`` (one rank of a launch) loads the
checkpoint sharded, trains, and writes its losses and parameter classes to
``FOLDER/TAG_rank<r>.json``. Needs transformers and accelerate (never shardwise's deps)."""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 3


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=64, tie_word_embeddings=False)


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


def main(mode: str, folder: str, tag: str = "") -> None:
    ckpt = os.path.join(folder, "ckpt")
    if mode == "setup":
        torch.manual_seed(0)
        LlamaForCausalLM(config()).save_pretrained(ckpt)
        model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        with open(os.path.join(folder, "reference.json"), "w") as f:
            json.dump({"losses": train(model)}, f)
        return
    model = LlamaForCausalLM.from_pretrained(ckpt, tp_plan="auto", dtype=torch.float32)
    classes = sorted({f"{type(p).__module__}.{type(p).__name__}" for p in model.parameters()})
    with open(os.path.join(folder, f"{tag}_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"losses": train(model), "classes": classes}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
