"""QK-clip (Kimi K2's MuonClip; Megatron-Core's ``--qk-clip``): a channel from attention layers
to the training step that keeps attention logits from growing without bound.

An attention layer of a run with ``--qk-clip`` calls :func:`record_max_logits` in each training
forward with the largest pre-softmax logit of each of its (local) heads and the fused QKV weight
that made them (declared with ``mark_fused_parts(..., kind="qkv")``: parts q, k, v per query
group). After each optimizer step that changed the weights, :func:`clip_qk` takes every
recorded layer's maxima (the maximum over data-parallel ranks), and for each query group whose
largest logit ``m`` exceeds ``--qk-clip-threshold t`` scales the group's query rows by
``(t / m) ** alpha`` and its key rows by ``(t / m) ** (1 - alpha)`` (``--qk-clip-alpha``), so
that the logit ``q . k`` falls to ``t``. The optimizer's fp32 main copies are scaled alike
(``MixedPrecisionOptimizer.scale_rows_``). Any attention plugin may use it: the core knows no
layer, only the weight and the maxima it is handed.
"""

from __future__ import annotations

import torch
from plugtron.core.parallel import comm
from plugtron.core.parallel.sharding import fused_part_rows, shard_of, tp_split_of

#: The attribute a layer's record lives on: ``(weight, maxima per local head)``.
RECORD = "_qk_clip_record"


def record_max_logits(module: torch.nn.Module, weight: torch.nn.Parameter,
                      max_logits: torch.Tensor) -> None:
    """Keep ``max_logits`` (one value per local attention head, in the weight's head order)
    for the next :func:`clip_qk`, the running maximum over the step's microbatches."""
    value = max_logits.detach().float()
    record = getattr(module, RECORD, None)
    if record is not None:
        value = torch.maximum(record[1], value)
    setattr(module, RECORD, (weight, value))


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
            weight, maxima = record
            comm.all_reduce(maxima, parallel.dp_cp_group, op=torch.distributed.ReduceOp.MAX)
            largest = max(largest, float(maxima.max()))
            scale = _row_scale(weight, maxima, parallel, threshold, alpha)
            if scale is not None:
                with torch.no_grad():
                    weight.mul_(scale.to(weight.dtype).unsqueeze(1))
                optimizer.scale_rows_(weight, scale)
    return largest


def _row_scale(weight, maxima: torch.Tensor, parallel, threshold: float,
               alpha: float) -> torch.Tensor | None:
    """The factor of each of this rank's rows of ``weight``; None when no group is clipped."""
    _, rank, size = tp_split_of(weight, parallel)
    rows = weight.shape[0] * (size if getattr(weight, "partition_dim", None) == 0 else 1)
    declared = fused_part_rows(weight, rows)
    if declared is None or declared[0] != "qkv":
        raise ValueError("QK-clip needs the layer's fused QKV weight, declared with "
                         "mark_fused_parts(weight, (q, k, v), groups, kind='qkv')")
    parts = declared[1]
    _, sizes, groups = weight.fused_parts
    group_of_row = torch.arange(groups).repeat_interleave(sum(sizes))
    chunks = getattr(weight, "partition_chunks", 1)
    if size > 1 and getattr(weight, "partition_dim", None) == 0:
        parts = shard_of(parts, 0, rank, size, chunks)
        group_of_row = shard_of(group_of_row, 0, rank, size, chunks)
    local_groups, local_group = torch.unique(group_of_row, return_inverse=True)
    group_max = maxima.view(len(local_groups), -1).amax(dim=1)
    if not bool((group_max > threshold).any()):
        return None
    eta = torch.clamp(threshold / group_max, max=1.0)
    factor = torch.ones(parts.shape, dtype=torch.float32)
    factor[parts == 0] = eta[local_group[parts == 0]] ** alpha
    factor[parts == 1] = eta[local_group[parts == 1]] ** (1 - alpha)
    return factor.to(weight.device)
