"""Multi-process glue: torchrun's environment -> a process group (NCCL on GPU, gloo on CPU), and a
DistributedSampler that can start mid-epoch (for exact resume)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


def setup(device_type: str) -> tuple[int, int]:
    """Join the process group when launched by torchrun (RANK / WORLD_SIZE set); returns (rank, world)."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def mean_across(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over all processes (itself when not distributed)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def sum_across(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value)
    return value


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class ResumableSampler(DistributedSampler):
    """torch's DistributedSampler (same shuffle, padding and rank striding) that can skip the first
    `start` indices of this rank's share of an epoch, so a resumed run sees exactly the batches it would
    have seen."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start
