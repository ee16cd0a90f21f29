"""Parameters shared between pipeline stages (tied embeddings and the like).

A model declares, on every stage that holds a copy, ``share_parameter(param, group)``, where the
group is the parameter's name on the first stage (``embedding.word_embeddings.weight`` for
GPT's tied output layer). The copies start equal (the model initialises them from the same init
key), their gradients are summed between the first and last pipeline stage after backward
(Megatron's embedding group), each element counts once in the grad norm (on the first stage),
and the checkpoint stores the tensor once, under that name, so checkpoints keep the model's own
names and load into any layout (at pp 1 the one parameter simply has that name). Naming the
group by the first stage's parameter keeps this free of communication: converters and offline
tools know the stored name too. Copies may live on the first and last stage only. Under a
V-shape placement both stages are chunks of rank 0: the two copies there are summed locally.
"""

from __future__ import annotations

import torch
from plugtron.core.errors import ConfigError
from plugtron.core.parallel import comm
from plugtron.core.parallel.context import stage_owner

ATTRIBUTE = "shared_group"
#: Set on the copies that are not the first stage's (they do not count in the grad norm).
REPLICA = "shared_replica"


def share_parameter(param: torch.nn.Parameter, group: str) -> torch.nn.Parameter:
    """Declare ``param`` one copy of the shared tensor named ``group`` (its parameter name on
    the first pipeline stage); returns ``param``."""
    if not group or not isinstance(group, str):
        raise ValueError("share_parameter needs a non-empty group name")
    setattr(param, ATTRIBUTE, group)
    return param


def group_of(param: torch.Tensor) -> str | None:
    return getattr(param, ATTRIBUTE, None)


def _named_shared(model_chunks) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(group, name, param) of this rank's shared parameters, sorted by group."""
    out = []
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, param in module.named_parameters():
            group = group_of(param)
            if group:
                out.append((group, name, param))
    return sorted(out, key=lambda item: item[0])


def _gather_over_pipeline(value, parallel) -> list:
    if parallel.pp_size == 1:
        return [value]
    out = [None] * parallel.pp_size
    torch.distributed.all_gather_object(out, value, group=parallel.pp_group)
    return out


def check_placement(model_chunks, parallel) -> None:
    """Every shared group must be held by the first and the last stage and nowhere else, with
    one shape, and be a parameter of that name on the first stage (a collective over the
    pipeline group). Marks the copies that are not the first stage's."""
    shared = _named_shared(model_chunks)
    for group, name, param in shared:
        setattr(param, REPLICA, name != group)
    if parallel.pp_size == 1:
        return
    local: dict = {}
    for group, name, param in shared:
        entry = local.setdefault(group, {"shapes": [], "first": False})
        entry["shapes"].append(list(param.shape))
        entry["first"] = entry["first"] or name == group
    per_stage = _gather_over_pipeline(local, parallel)
    stages = parallel.pp_size * (parallel.vp_size or 1)
    wanted = sorted({stage_owner(0, parallel.pp_size, parallel.pipeline_placement)[0],
                     stage_owner(stages - 1, parallel.pp_size, parallel.pipeline_placement)[0]})
    copies_wanted = 2 if len(wanted) == 1 else 1
    for group in sorted({g for stage in per_stage for g in stage}):
        holders = [r for r, stage in enumerate(per_stage) if group in stage]
        shapes = {tuple(shape) for r in holders for shape in per_stage[r][group]["shapes"]}
        copies = {len(per_stage[r][group]["shapes"]) for r in holders}
        if holders != wanted or len(shapes) != 1 or copies != {copies_wanted}:
            raise ConfigError(f"shared parameter group {group!r} is held by pipeline stages "
                              f"{holders} with shapes {sorted(shapes)}; shared copies must live "
                              f"on the first and the last stage, with one shape")
        if not per_stage[0][group]["first"]:
            raise ConfigError(f"shared parameter group {group!r} must be named after the first "
                              f"stage's parameter: the first stage has no parameter {group!r}")


def allreduce_grads(model_chunks, parallel, grad_of) -> None:
    """Sum the gradients of each shared group over its copies: the ones of this rank (two
    under a V-shape placement), then between the first and last stage's ranks."""
    if parallel.pp_size == 1:
        return
    by_group: dict[str, list[torch.Tensor]] = {}
    for group, _, param in _named_shared(model_chunks):
        grad = grad_of(param)
        if grad is not None:
            by_group.setdefault(group, []).append(grad)
    if not by_group:
        return
    sums = [grads[0] if len(grads) == 1 else torch.stack(grads).sum(dim=0)
            for grads in by_group.values()]
    if comm.group_size(parallel.embedding_group) > 1:
        flat = torch.cat([g.reshape(-1) for g in sums])
        comm.all_reduce(flat, parallel.embedding_group)
        offset, split = 0, []
        for g in sums:
            split.append(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        sums = split
    elif all(len(grads) == 1 for grads in by_group.values()):
        return  # nothing to sum: the other copies live on ranks outside an embedding group
    for total, grads in zip(sums, by_group.values()):
        for g in grads:
            if g is not total:
                g.copy_(total)


def counts_once(param: torch.Tensor, parallel) -> bool:
    """Whether this copy counts in the grad norm: only the first stage's does."""
    return group_of(param) is None or (parallel.is_pipeline_first_stage()
                                       and not getattr(param, REPLICA, False))
