"""Joining the world of ranks: torchrun's environment (or SLURM's, under ``srun``), backend and
device choice."""

from __future__ import annotations

import datetime
import itertools
import os
import re
from dataclasses import dataclass

import torch
from plugtron.core.errors import ConfigError
from torch.distributed import distributed_c10d


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device


def launched_externally() -> bool:
    """True under torchrun (or any launcher that sets the usual variables), and under ``srun``
    with several tasks, whose SLURM variables are first turned into torchrun's
    (:func:`adopt_slurm_world`), so that every later reader of ``RANK``/``WORLD_SIZE`` sees
    them."""
    adopt_slurm_world()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


#: Set to 0 to ignore SLURM's variables (e.g. plugtron's own launcher inside a batch script
#: that asked for several tasks but runs one ``plugtron train --nproc-per-node N``).
SLURM_SWITCH_ENV = "PLUGTRON_SLURM"
#: ``MASTER_PORT`` under srun when the environment has none: this base plus the job id modulo
#: 10000 (below Linux's ephemeral ports), so two jobs sharing a first node rarely collide.
SLURM_PORT_BASE = 15000


def expand_nodelist(nodelist: str):
    """The host names of SLURM's compressed node list, in order, lazily: ``node[01-03,07]``
    -> node01, node02, node03, node07; ``a,b``; ``gpu-[1-2]``; ``r[1-2]-n[1-2]`` (several
    bracket groups: every combination, the last group varying fastest). Zero padding of a
    range's first bound is kept. ``ValueError`` on a malformed list."""
    for item in _split_outside_brackets(nodelist):
        yield from _expand_item(item)


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in node list {text!r}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth or not current:
        raise ValueError(f"malformed node list {text!r}")
    return [*items, current]


def _expand_item(item: str):
    if not item:
        raise ValueError("empty host name in node list")
    parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
    choices = [[parts[0]]]
    for ranges, text in zip(parts[1::2], parts[2::2]):
        choices.append(list(_numbers(ranges)))
        choices.append([text])
    if "[" in "".join(parts[::2]) or "]" in "".join(parts[::2]):
        raise ValueError(f"malformed host {item!r} in node list")
    for combo in itertools.product(*choices):
        yield "".join(combo)


def _numbers(ranges: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"malformed range {part!r} in node list")
        width = len(low)
        out += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return out


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's count in SLURM_TASKS_PER_NODE's compressed form (``2(x3),1``)."""
    counts = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"malformed SLURM_TASKS_PER_NODE {tasks_per_node!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts[min(node_id, len(counts) - 1)]


def slurm_world(env) -> dict[str, str] | None:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) from SLURM's in ``env``, for a task that ``srun`` started; None when ``env``
    is not such a task (no SLURM_PROCID/SLURM_NTASKS, a single task, or ``PLUGTRON_SLURM=0``)
    or when RANK/WORLD_SIZE are already set (torchrun under SLURM)."""
    if "RANK" in env or "WORLD_SIZE" in env or env.get(SLURM_SWITCH_ENV) == "0":
        return None
    if "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("srun task without SLURM_NODELIST / SLURM_JOB_NODELIST: the first "
                         "node cannot be found")
    if "SLURM_NTASKS_PER_NODE" in env:
        local_world = int(env["SLURM_NTASKS_PER_NODE"].split("(")[0].split(",")[0])
    elif "SLURM_TASKS_PER_NODE" in env:
        local_world = tasks_on_node(env["SLURM_TASKS_PER_NODE"],
                                    int(env.get("SLURM_NODEID", 0)))
    else:
        local_world = int(env["SLURM_NTASKS"])
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    port = env.get("MASTER_PORT") or str(SLURM_PORT_BASE + int(job_id) % 10000)
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": env.get("MASTER_ADDR") or next(expand_nodelist(nodelist)),
            "MASTER_PORT": port}


def adopt_slurm_world() -> None:
    """Under ``srun`` (no torchrun), write SLURM's world into torchrun's variables."""
    try:
        world = slurm_world(os.environ)
    except ValueError as exc:
        raise ConfigError(f"cannot read the world from SLURM's variables: {exc}") from None
    if world:
        os.environ.update(world)


def single_process(device: str = "cpu") -> WorldInfo:
    """A world of one, e.g. for a reference run inside a process that is part of a bigger
    world."""
    return WorldInfo(0, 1, 0, 1, torch.device(device))


def timeout_seconds(config) -> float:
    """``--distributed-timeout-minutes`` in seconds (Megatron's default: 10 minutes)."""
    minutes = getattr(config.parallel, "distributed_timeout_minutes", None) or 10
    return float(minutes) * 60


def init_distributed(timeout_s: float = 600) -> WorldInfo:
    """Join the world torchrun (or srun) describes, or the one already initialised in this
    process."""
    if torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        device = torch.device("cpu")
        if torch.distributed.get_backend() == "nccl":
            device = torch.device(f"cuda:{torch.cuda.current_device()}")
        return WorldInfo(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)),
                         int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), device)
    adopt_slurm_world()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_cuda = torch.cuda.is_available()
    # srun binding one GPU per task (--gpus-per-task 1) leaves each rank one visible device.
    index = local_rank if use_cuda and torch.cuda.device_count() > 1 else 0
    device = torch.device(f"cuda:{index}") if use_cuda else torch.device("cpu")
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
    attempt = elastic_restart_count()
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout)
    return torch.distributed.PrefixStore(f"plugtron/attempt_{attempt}", store)


def elastic_restart_count() -> int:
    """How many times torch elastic has restarted this worker group (0: the first attempt,
    or not under torch elastic)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


