"""Multi-process glue: torchrun's environment -> a process group (NCCL on GPU, torch_xla's own "xla" backend on
XLA devices, gloo on CPU), a DistributedSampler that can start mid-epoch (for exact resume), and the sharding
of the evaluation set over the processes."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


def setup(device_type: str) -> tuple[int, int]:
    """Join the process group when launched by torchrun (RANK / WORLD_SIZE set); returns (rank, world)."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    if not dist.is_initialized():
        if device_type == "xla":
            from vit_serve.train import xla

            xla.init_process_group()
        else:
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def restart_hazard(env: Mapping[str, str] = os.environ) -> str | None:
    """Why torchrun may fail to restart this worker group (`--max-restarts`), or None.

    By default torch's c10d rendezvous lets every worker group of a job share the agent's TCPStore, with no
    namespace per attempt, so a restarted group can read the addresses the killed one left there and fail to
    connect (pytorch/pytorch#135712, still so in torch 2.14); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, set for
    torchrun, gives every attempt a store of its own."""
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("torchrun --max-restarts with the rendezvous store shared across attempts: a restarted group may "
                "read the killed group's addresses and fail to connect; run torchrun with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")
    return None


def teardown() -> None:
    """Leave the process group, all ranks together: a rank that destroys its gloo group while another still
    works on its last files can abort on exit ("terminate called without an active exception")."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def sum_across(value: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor over all processes (itself when not distributed). Under NCCL (and XLA) it must live on
    the device."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value)
    return value


def mean_across(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over all processes (itself when not distributed)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return sum_across(value) / dist.get_world_size()
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


class ShardSampler(torch.utils.data.Sampler[int]):
    """Indices rank, rank + world, ... of a dataset of `size`: every index exactly once over all ranks
    (no padding, unlike DistributedSampler), so per-rank counts add up to the whole set's."""

    def __init__(self, size: int, num_replicas: int, rank: int) -> None:
        self.indices = range(rank, size, num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
