"""``--check-weight-hash-across-dp-replicas-interval N`` (Megatron's flag): every N iterations,
after the step, each rank hashes its parameters and the data-parallel replicas compare them
(dense parameters over data x context parallelism, expert parameters over expert data
parallelism). Replicas of one model must hold the same bits; one that silently diverged (a bit
flip in memory, a reduction that went wrong) stops the run, naming the ranks and the first
parameter that differs, before it trains on or is saved. Parameters sharded over the replicas
(fsdp2) have no replicas to compare and are refused at validation.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from plugtron.core.errors import ConfigError, PlugtronError
from plugtron.core.parallel.sharding import is_dtensor, is_expert


class ReplicasDiverged(PlugtronError):
    """Data-parallel replicas hold different parameters."""


def validate_replica_check(config) -> None:
    interval = config.training.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval < 1:
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval must be at least "
                          f"1, got {interval}")


def digests(model_chunks) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(dense, expert)`` lists of (parameter name, sha256 of its bytes) of this rank."""
    dense: list[tuple[str, str]] = []
    expert: list[tuple[str, str]] = []
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, param in module.named_parameters():
            if is_dtensor(param):
                raise ConfigError("--check-weight-hash-across-dp-replicas-interval: the "
                                  "parameters are sharded over the replicas (fsdp2); there are "
                                  "no replicas to compare")
            data = param.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
            (expert if is_expert(param) else dense).append((name, digest))
    return dense, expert


def _compare(mine: list[tuple[str, str]], group, ranks: list[int], what: str) -> None:
    if len(ranks) < 2:
        return
    gathered: list[list[tuple[str, str]]] = [[] for _ in ranks]
    dist.all_gather_object(gathered, mine, group=group)
    reference = dict(gathered[0])
    for rank, theirs in zip(ranks[1:], gathered[1:]):
        for name, digest in theirs:
            if reference.get(name) != digest:
                raise ReplicasDiverged(
                    f"{what} replicas differ: rank {ranks[0]} and rank {rank} hold different "
                    f"values of {name} (the first parameter that differs); a replica diverged "
                    f"silently (a hardware fault or a broken reduction), so the run stops "
                    f"before it trains on or saves it; resume from the last checkpoint")


def check_replicas(run, iteration: int, at_start: bool = False) -> bool:
    """Compare the replicas when ``iteration`` is a multiple of the interval (or ``at_start``:
    once before training, so a replica that loaded differently is caught at once and an
    unsupported layout refused); True if checked. Collective over each replica group."""
    interval = run.config.training.check_weight_hash_across_dp_replicas_interval
    if not interval or (iteration % interval and not at_start):
        return False
    for chunk in run.model_chunks:  # gathers in flight after the step land first
        chunk.finish_param_sync()
    dense, expert = digests(run.model_chunks)
    p = run.parallel
    _compare(dense, p.dp_cp_group, p.ranks["dp-cp"], "data-parallel")
    _compare(expert, p.edp_group, p.ranks["edp"], "expert data-parallel")
    return True
