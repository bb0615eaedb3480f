"""Data-parallel drafter training under `torchrun`, on PyTorch's DistributedDataParallel: every rank holds the
target and the drafter, draws the same global batch from the same seeded generator, trains on its own contiguous
share of the rows, and DDP averages the gradients. Rank 0 builds the data, evaluates and saves; the others wait.

    torchrun --nproc_per_node 8 -m dtrt.cli train-drafter --model qwen3-4b --device cuda ...

Without torchrun's environment (WORLD_SIZE unset) nothing here starts a process group."""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from dtrt.errors import DtrtError

# rank 0 builds the data while the others wait at a barrier: a long build must not look like a hung rank
BUILD_TIMEOUT = timedelta(hours=12)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_env(env=None) -> Ranks:
    env = os.environ if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise DtrtError("WORLD_SIZE, RANK and LOCAL_RANK must be integers (set by torchrun)") from None
    if world < 1 or not 0 <= rank < world:
        raise DtrtError(f"RANK {rank} is not in WORLD_SIZE {world}: launch with torchrun")
    return Ranks(rank, world, local)


def shard(batch: int, ranks: Ranks) -> slice:
    """The rows of a global batch this rank trains on: contiguous shares whose sizes differ by at most one."""
    if batch < ranks.world:
        raise DtrtError(f"--batch {batch}: smaller than the {ranks.world} processes; give at least one row to each")
    base, extra = divmod(batch, ranks.world)
    start = ranks.rank * base + min(ranks.rank, extra)
    return slice(start, start + base + (ranks.rank < extra))


def device_for(device: str, ranks: Ranks) -> str:
    """Each rank's device: its own GPU (LOCAL_RANK) under torchrun."""
    return f"cuda:{ranks.local}" if device.startswith("cuda") and ranks.world > 1 else device


def start(ranks: Ranks, device: str):
    if ranks.world == 1:
        return
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=BUILD_TIMEOUT)


def barrier(ranks: Ranks):
    if ranks.world > 1:
        import torch.distributed as dist

        dist.barrier()


def mean(t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """`t` averaged over the ranks (itself with one)."""
    if ranks.world == 1:
        return t
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t / ranks.world


def stop(ranks: Ranks, finished: bool = True):
    """Leave the process group: after every rank is done when `finished` (tearing gloo down under a rank still
    working aborts it), at once after a failure (the other ranks may never arrive; torchrun stops them)."""
    if ranks.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def wrap(model: torch.nn.Module, ranks: Ranks, device: str) -> torch.nn.Module:
    """`model` under DistributedDataParallel when there are several ranks."""
    if ranks.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None
    )
