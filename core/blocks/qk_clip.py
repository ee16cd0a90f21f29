"""QK-clip (Kimi K2's MuonClip; Megatron-Core's ``--qk-clip``): a channel from attention layers
to the training step that keeps attention logits from growing without bound.

An attention layer of a run with ``--qk-clip`` calls :func:`record_max_logits` in each training
forward with the largest pre-softmax logit of each of its (local) heads and the weights that
made the queries and keys. Each weight says which of its rows QK-clip scales: a fused QKV
(``mark_fused_parts(..., kind="qkv")``: parts q, k, v per query group), or any projection whose
rows are per head (:func:`mark_qk_clip_rows`: MLA's query and key up-projections). After each
optimizer step that changed the weights, :func:`clip_qk` takes every recorded layer's maxima
(the maximum over data-parallel ranks), and for each query group (or head) whose largest logit
``m`` exceeds ``--qk-clip-threshold t`` scales its query rows by ``(t / m) ** alpha`` and its
key rows by ``(t / m) ** (1 - alpha)`` (``--qk-clip-alpha``), so that the logit ``q . k``
falls to ``t``; a query part that meets a key shared by every head (MLA's rotary part), which
cannot be scaled per head, takes the whole ``t / m``. The optimizer's fp32 main copies are
scaled alike (``MixedPrecisionOptimizer.scale_rows_``). Any attention plugin may use it: the
core knows no layer, only the weights and the maxima it is handed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from plugtron.core.parallel import comm
from plugtron.core.parallel.sharding import (
    fused_part_rows,
    is_dtensor,
    local_tensor,
    shard_like,
    shard_of,
    tp_split_of,
)

#: The attribute a layer's record lives on: ``(weight names in the layer, maxima per local
#: head)``. Names, not the tensors: under fsdp2 the forward sees the gathered parameters, the
#: step the data-parallel shards registered under the same names.
RECORD = "_qk_clip_record"
#: The attribute :func:`mark_qk_clip_rows` sets on a weight: ``(per_head, heads)``.
ROWS = "qk_clip_rows"
#: What a row gets of its head's factor ``eta = t / m``: its power, by role.
ROLES = ("none", "query", "key", "query_whole")


def mark_qk_clip_rows(weight: torch.nn.Parameter, per_head: Sequence[tuple[int, str]],
                      heads: int) -> None:
    """Declare how QK-clip scales the rows of ``weight``, a projection whose rows are grouped
    by attention head: ``heads`` blocks (every tensor-parallel rank's, in order) of the rows
    ``per_head`` lists as ``(rows, role)``. Roles: ``"query"`` (``eta ** alpha``), ``"key"``
    (``eta ** (1 - alpha)``), ``"query_whole"`` (``eta``: a query part whose key is not
    scaled, being shared by the heads) and ``"none"`` (values)."""
    unknown = sorted({role for _, role in per_head} - set(ROLES))
    if unknown:
        raise ValueError(f"unknown QK-clip row roles {unknown} (one of {', '.join(ROLES)})")
    setattr(weight, ROWS, (tuple((int(n), role) for n, role in per_head), int(heads)))


def record_max_logits(module: torch.nn.Module,
                      weight: torch.nn.Parameter | Sequence[torch.nn.Parameter],
                      max_logits: torch.Tensor) -> None:
    """Keep ``max_logits`` (one value per local attention head, in the weights' head order)
    for the next :func:`clip_qk`, the running maximum over the step's microbatches.
    ``weight``: the fused QKV weight, or the weights :func:`mark_qk_clip_rows` declared."""
    weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    names = {id(p): name for name, p in module.named_parameters()}
    missing = [i for i, w in enumerate(weights) if id(w) not in names]
    if missing:
        raise ValueError(f"record_max_logits: weight {missing[0]} is not a parameter of the "
                         f"module handed in (give the attention layer that holds it)")
    value = max_logits.detach().float()
    record = getattr(module, RECORD, None)
    if record is not None:
        value = torch.maximum(record[1], value)
    setattr(module, RECORD, (tuple(names[id(w)] for w in weights), value))


def clip_qk(model_chunks, optimizer, parallel, threshold: float, alpha: float) -> float:
    """Scale the query and key rows of every group whose logit exceeded ``threshold`` (after
    the optimizer step, on every rank); returns the largest logit of the step (0.0 when no
    layer recorded one), for the metrics. Collective over dp x cp."""
    largest = 0.0
    for chunk in model_chunks:
        for module in getattr(chunk, "module", chunk).modules():
            record = getattr(module, RECORD, None)
            if record is None:
                continue
            delattr(module, RECORD)
            names, maxima = record
            comm.all_reduce(maxima, parallel.dp_cp_group, op=torch.distributed.ReduceOp.MAX)
            largest = max(largest, float(maxima.max()))
            for name in names:
                weight = module.get_parameter(name)
                scale = _row_scale(weight, maxima, parallel, threshold, alpha)
                if scale is not None:
                    _scale_rows_(weight, scale)
                    optimizer.scale_rows_(weight, scale)
    return largest


@torch.no_grad()
def _scale_rows_(weight: torch.nn.Parameter, scale: torch.Tensor) -> None:
    """Row ``i`` of ``weight`` (this tp rank's rows) times ``scale[i]``; under fsdp2, where
    ``weight`` is a DTensor split over data parallelism by rows, on this rank's shard of them."""
    factor = scale.to(weight.dtype).unsqueeze(1)
    if is_dtensor(weight):
        factor = local_tensor(shard_like(factor.expand(weight.shape).contiguous(), weight))
    local_tensor(weight).mul_(factor)


def _rows(weight, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unit, role)`` of each of the ``rows`` rows of the whole ``weight``: the query group
    (or head) the row belongs to, and its index in :data:`ROLES`."""
    declared = getattr(weight, ROWS, None)
    if declared is not None:
        per_head, heads = declared
        roles = torch.tensor([ROLES.index(role) for n, role in per_head for _ in range(n)])
        return (torch.arange(heads).repeat_interleave(len(roles)), roles.repeat(heads))
    fused = fused_part_rows(weight, rows)
    if fused is None or fused[0] != "qkv":
        raise ValueError("QK-clip needs the layer's fused QKV weight (mark_fused_parts(weight, "
                         "(q, k, v), groups, kind='qkv')) or weights whose rows are declared "
                         "with mark_qk_clip_rows")
    _, sizes, groups = weight.fused_parts
    role_of_part = torch.tensor([ROLES.index("query"), ROLES.index("key"), ROLES.index("none")])
    return torch.arange(groups).repeat_interleave(sum(sizes)), role_of_part[fused[1]]


def _row_scale(weight, maxima: torch.Tensor, parallel, threshold: float,
               alpha: float) -> torch.Tensor | None:
    """The factor of each of this rank's rows of ``weight``; None when no group is clipped."""
    _, rank, size = tp_split_of(weight, parallel)
    split_rows = size > 1 and getattr(weight, "partition_dim", None) == 0
    unit_of_row, role = _rows(weight, weight.shape[0] * (size if split_rows else 1))
    if split_rows:
        chunks = getattr(weight, "partition_chunks", 1)
        unit_of_row = shard_of(unit_of_row, 0, rank, size, chunks)
        role = shard_of(role, 0, rank, size, chunks)
    local_units, local_unit = torch.unique(unit_of_row, return_inverse=True)
    unit_max = maxima.view(len(local_units), -1).amax(dim=1)
    if not bool((unit_max > threshold).any()):
        return None
    eta = torch.clamp(threshold / unit_max, max=1.0).cpu()[local_unit]
    power = torch.tensor([0.0, alpha, 1.0 - alpha, 1.0])[role]
    return (eta ** power).to(weight.device)
