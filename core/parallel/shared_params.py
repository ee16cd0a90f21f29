"""Parameters shared between pipeline stages (tied embeddings and the like).

A model declares, on every stage that holds a copy, ``share_parameter(param, group)``, where the
group is the parameter's name on the first stage (``embedding.word_embeddings.weight`` for
GPT's tied output layer). The copies start equal (the model initialises them from the same init
key), their gradients are summed between the first and last pipeline stage after backward
(Megatron's embedding group), each element counts once in the grad norm (on the first stage),
and the checkpoint stores the tensor once, under that name, so checkpoints keep the model's own
names and load into any layout (at pp 1 the one parameter simply has that name). Naming the
group by the first stage's parameter keeps this free of communication: converters and offline
tools know the stored name too. Copies may live on the first and last stage only.
"""

from __future__ import annotations

import torch
from plugtron.core.errors import ConfigError
from plugtron.core.parallel import comm

ATTRIBUTE = "shared_group"


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
    pipeline group)."""
    shared = _named_shared(model_chunks)
    if parallel.pp_size == 1:
        return
    local = {group: (list(param.shape), name == group) for group, name, param in shared}
    per_stage = _gather_over_pipeline(local, parallel)
    for group in sorted({g for stage in per_stage for g in stage}):
        holders = [r for r, stage in enumerate(per_stage) if group in stage]
        shapes = {tuple(per_stage[r][group][0]) for r in holders}
        if holders != sorted({0, parallel.pp_size - 1}) or len(shapes) != 1:
            raise ConfigError(f"shared parameter group {group!r} is held by pipeline stages "
                              f"{holders} with shapes {sorted(shapes)}; shared copies must live "
                              f"on the first and the last stage, with one shape")
        if not per_stage[0][group][1]:
            raise ConfigError(f"shared parameter group {group!r} must be named after the first "
                              f"stage's parameter: the first stage has no parameter {group!r}")


def allreduce_grads(model_chunks, parallel, grad_of) -> None:
    """Sum the gradients of each shared group between the first and last stage."""
    if parallel.pp_size == 1 or comm.group_size(parallel.embedding_group) == 1:
        return
    grads = [grad_of(p) for _, _, p in _named_shared(model_chunks)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, parallel.embedding_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def counts_once(param: torch.Tensor, parallel) -> bool:
    """Whether this copy counts in the grad norm: only the first stage's does."""
    return group_of(param) is None or parallel.is_pipeline_first_stage()
