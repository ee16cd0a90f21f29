"""Joining the world of ranks: torchrun's environment, backend and device choice."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
from torch.distributed import distributed_c10d


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device


def launched_externally() -> bool:
    """True under torchrun (or any launcher that sets the usual variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def single_process(device: str = "cpu") -> WorldInfo:
    """A world of one, e.g. for a reference run inside a process that is part of a bigger
    world."""
    return WorldInfo(0, 1, 0, 1, torch.device(device))


def timeout_seconds(config) -> float:
    """``--distributed-timeout-minutes`` in seconds (Megatron's default: 10 minutes)."""
    minutes = getattr(config.parallel, "distributed_timeout_minutes", None) or 10
    return float(minutes) * 60


def init_distributed(timeout_s: float = 600) -> WorldInfo:
    """Join the world torchrun describes, or the one already initialised in this process."""
    if torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        device = torch.device("cpu")
        if torch.distributed.get_backend() == "nccl":
            device = torch.device(f"cuda:{torch.cuda.current_device()}")
        return WorldInfo(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)),
                         int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), device)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    elif local_world > 1:
        # Ranks share the cores; oversubscribing threads makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world_size > 1 and not torch.distributed.is_initialized():
        # Subgroups (tp, pp, dp, ...) take torch's default timeout (30 min), not the world's:
        # make it this one so that every collective and P2P wait is bounded by it.

        distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=timeout_s)
        if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
            distributed_c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        torch.distributed.init_process_group(
            backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
            timeout=timeout, store=restart_store(world_size, timeout))
    return WorldInfo(rank, world_size, local_rank, local_world, device)


def restart_store(world_size: int, timeout: datetime.timedelta):
    """Under torch elastic with the agent's store (torchrun's default), that store outlives a
    restart of the worker group and still holds the keys the failed attempt's ranks wrote; a
    new rank that asks for a peer's address before the peer has written it again reads the
    dead one's ("Gloo connectFullMesh failed ... Connection refused"). Each attempt gets keys of
    its own (``TORCHELASTIC_RESTART_COUNT``). None elsewhere: ``init_process_group`` builds the
    usual store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout)
    return torch.distributed.PrefixStore(f"plugtron/attempt_{attempt}", store)


def shutdown(barrier: bool = False) -> None:
    if torch.distributed.is_initialized():
        if barrier:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
