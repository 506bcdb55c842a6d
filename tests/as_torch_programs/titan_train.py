"""torchtitan's own training entry point (``torchtitan.train.main(Trainer)``) on a tiny Llama 3.

``setup FOLDER`` writes what torchtitan reads: a word-level tokenizer, a small text dataset in
the layout of its ``c4_test`` data and a ``debugmodel`` job config (float32, a short sequence).
``rank FOLDER TAG [ARG...]`` (one rank of a launch) runs torchtitan's ``main`` with that config
and the extra torchtitan arguments, and writes the losses and gradient norms its trainer logs to
``FOLDER/TAG_rank<r>.json``. Initial weights differ with the parallelism (each DTensor RNG
draws its own), so every run starts, as torchtitan advises, from one seed checkpoint: ``rank
FOLDER seed`` on one process writes it (``--checkpoint.create_seed_checkpoint``), the other tags
load it (``--checkpoint.initial_load_path``) and save their last step (DCP). torchtitan picks
CUDA when no accelerator is found, so the run first names the CPU as its device (its device
module answers the few memory queries with zeros), and torch's FSDP2 modules reduce with plain
sums (gloo lacks the PREMUL_SUM they use); rank threads parse the arguments one at a time
(torchtitan's parser, tyro, keeps a process-wide stack) and share one tqdm lock (datasets'
loader). Nothing else of torchtitan is changed. Needs torchtitan 0.2.2 (never shardwise's
dependency).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import types

import torch

WORDS = [f"w{i}" for i in range(200)]


def setup(folder: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    assets = os.path.join(folder, "tokenizer")
    os.makedirs(assets, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<bos>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(assets, "tokenizer.json"))
    with open(os.path.join(assets, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>"}, f)
    data = os.path.join(folder, "data")
    os.makedirs(data, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(data, "train.json"), "w") as f:
        for _ in range(64):
            n = int(torch.randint(8, 40, (1,), generator=g))
            ids = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in ids)}) + "\n")
    with open(os.path.join(folder, "job.toml"), "w") as f:
        f.write(f"""
[job]
dump_folder = "{folder}/out"
[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "{assets}"
[optimizer]
name = "AdamW"
lr = 8e-4
[lr_scheduler]
warmup_steps = 2
[training]
local_batch_size = 2
seq_len = 32
steps = 3
max_norm = 1.0
dataset = "c4_test"
dataset_path = "{data}"
mixed_precision_param = "float32"
[metrics]
log_freq = 1
[activation_checkpoint]
mode = "none"
[compile]
enable = false
""")


def _cpu_device() -> None:
    """torchtitan's device (chosen as it is imported): the CPU, with a device module that
    reports no memory."""
    import torch._utils as torch_utils

    module = types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        synchronize=lambda device=None: None,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 30),
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        memory_stats=lambda device=None: {},
    )
    found, get_module = torch_utils._get_available_device_type, torch_utils._get_device_module
    torch_utils._get_available_device_type = lambda: "cpu"
    torch_utils._get_device_module = lambda device_type: module
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        torch_utils._get_available_device_type, torch_utils._get_device_module = found, get_module


def rank(folder: str, tag: str, *extra: str) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if tag == "seed":
        ckpt = ["--checkpoint.create_seed_checkpoint", "--checkpoint.folder=seed"]
    else:
        ckpt = [f"--checkpoint.initial_load_path={folder}/out/seed/step-0",
                f"--checkpoint.folder=ckpt_{tag}"]
    config = os.path.join(folder, "job.toml")
    args = ["--job.config_file", config, "--checkpoint.enable", *ckpt, *extra]
    _cpu_device()
    import torchtitan.config.manager as manager
    from torchtitan.train import Trainer, main

    # main() parses the command line its parser saw at import (sys.argv[1:], shared by rank
    # threads): it parses these arguments instead, the same in every rank; tyro, its parser,
    # keeps a process-wide stack while it parses, so rank threads parse one at a time
    lock = manager.__dict__.setdefault("_rank_threads_parse_lock", threading.Lock())
    parse = manager.ConfigManager.__dict__.get("_parse_args", manager.ConfigManager.parse_args)
    manager.ConfigManager._parse_args = parse

    def parse_args(self, _=None):
        with lock:
            return parse(self, args)

    manager.ConfigManager.parse_args = parse_args
    # datasets loads through tqdm's thread_map, which deletes the tqdm lock it made itself when
    # done, under other rank threads' feet: make it first, once for all
    from tqdm import tqdm

    tqdm.get_lock()

    records: list[tuple[float, float]] = []

    class Recording(Trainer):
        """torchtitan's Trainer, keeping what its metrics processor logs."""

        def __init__(self, job_config):
            super().__init__(job_config)
            log = self.metrics_processor.log

            def record(step, global_avg_loss, global_max_loss, grad_norm, **kwargs):
                records.append((float(global_avg_loss), float(grad_norm)))
                return log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

            self.metrics_processor.log = record
            # gloo has no PREMUL_SUM, which torch's FSDP2 reduce-scatters with when torchtitan
            # sets its divide factor to 1: torch's own switch to plain sums (same values)
            from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

            for part in self.model_parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.set_force_sum_reduction_for_comms(True)

    main(Recording)
    import torch.distributed.tensor as tensor_module

    out = {
        "losses": [r[0] for r in records],
        "grad_norms": [r[1] for r in records],
        "dtensor": tensor_module.DTensor.__module__,
    }
    with open(os.path.join(folder, f"{tag}_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    {"setup": setup, "rank": rank}[sys.argv[1]](*sys.argv[2:])
