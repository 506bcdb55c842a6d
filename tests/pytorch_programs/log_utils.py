# ruff: noqa
# Verbatim copy of distributed/tensor_parallelism/log_utils.py from https://github.com/pytorch/examples
# (commit 77f55b912142e11fcfdf5b530231fb9c52f181e8), BSD 3-Clause License, Copyright (c) 2017, Pytorch contributors.
# A user program shardwise is tested against: everything below this header is unchanged;
# tests/pytorch_programs/harness.py applies the documented CPU substitution to a copy.
import logging
import torch

logging.basicConfig(
    format="%(asctime)s %(message)s", datefmt="%m/%d/%Y %I:%M:%S %p", level=logging.INFO
)

def get_logger():
    return logging.getLogger(__name__)


def rank_log(_rank, logger, msg):
    """helper function to log only on global rank 0"""
    if _rank == 0:
        logger.info(f" {msg}")


def verify_min_gpu_count(min_gpus: int = 2) -> bool:
    """ verification that we have at least 2 gpus to run dist examples """
    has_gpu = torch.accelerator.is_available()
    gpu_count = torch.accelerator.device_count()
    return has_gpu and gpu_count >= min_gpus
