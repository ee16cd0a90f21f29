"""Routing arithmetic, as Megatron-Core's moe_utils defines it (pure functions, no state).

Shapes: ``logits``/``scores``/``probs`` ``[tokens, experts]``; ``routing_map`` the boolean mask of
chosen (token, expert) pairs. ``probs`` is sparse: the routing weight where the map is set,
zero elsewhere.
"""

from __future__ import annotations

import math

import torch


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k inside the ``group_topk`` best of ``num_groups`` equal expert groups; a group's
    score is the sum of its best ``topk // group_topk`` expert scores."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=1)


def topk_routing(logits: torch.Tensor, topk: int, pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, score_function: str = "softmax",
                 expert_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` as ``topk_routing_with_score_function``:

    * softmax (post): top-k over the logits, softmax over the k chosen;
    * softmax with ``pre_softmax``: softmax over all experts, then top-k (not renormalised);
    * sigmoid: top-k on ``sigmoid(logits) + expert_bias``; weights are the unbiased scores of
      the chosen experts over their sum (when k > 1);
    * sqrtsoftplus: as sigmoid, with the scores ``sqrt(softplus(logits))``;
    * then times ``scaling_factor``. Intermediate maths in fp32, probs in the logits' dtype.
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        else:
            chosen, indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(chosen, dim=-1, dtype=torch.float32)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        scores = _scores(logits, score_function)
        if expert_bias is not None:
            _, indices = _topk(scores + expert_bias.float(), topk, num_groups, group_topk)
            chosen = torch.gather(scores, 1, indices)
        else:
            chosen, indices = _topk(scores, topk, num_groups, group_topk)
        probs = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else chosen
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
    return routing_probs, routing_map


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The unnormalised fp32 scores of the sigmoid-like score functions."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    return torch.nn.functional.softplus(logits.float()).sqrt()


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[tokens, experts]``: scale its rows and
    columns in turn (each row to sum 1/tokens, each column 1/experts) until the column scales
    move by less than ``tol`` on average; returns the scaled matrix (Megatron's
    ``moe_utils.sinkhorn``, 1e-8 added to every sum)."""
    kernel = torch.exp(cost)
    num_tokens, num_experts = kernel.shape
    row_scale = torch.ones(num_tokens, device=cost.device, dtype=cost.dtype)
    col_scale = torch.ones(num_experts, device=cost.device, dtype=cost.dtype)
    change = float("inf")
    while change > tol:
        row_scale = (1 / num_tokens) / (torch.sum(col_scale * kernel, 1) + 1e-8)
        new_col = (1 / num_experts) / (torch.sum(row_scale.unsqueeze(1) * kernel, 0) + 1e-8)
        change = float(torch.mean(torch.abs(col_scale - new_col)))
        col_scale = new_col
    return col_scale * kernel * row_scale.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int,
                     balance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` of sinkhorn routing (S-BASE; Megatron's
    ``TopKRouter.sinkhorn_load_balancing``). The weights are ``sigmoid(logits)`` for top-1,
    else the softmax over all experts, at the chosen experts (not renormalised). ``balance``
    (training): the experts are the top-k of the sinkhorn-balanced fp32 logits (no gradient
    through the choice); otherwise the top-k of the weights."""
    if topk == 1:
        weights = torch.sigmoid(logits)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if balance:
        with torch.no_grad():
            indices = torch.topk(sinkhorn(logits.to(torch.float32)), k=topk, dim=1).indices
    else:
        indices = torch.topk(weights, k=topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
    return weights * routing_map, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int,
                        score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map, scores)`` the balancing loss uses: softmax over all experts (or the
    normalised sigmoid or sqrtsoftplus scores) and their plain top-k, whatever the routing
    options."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        scores = _scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    indices = torch.topk(scores, k=topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
    return routing_map, scores


def switch_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                               total_num_tokens: float, topk: int, num_experts: int,
                               coeff: float) -> torch.Tensor:
    """``coeff x E / (k x T^2) x sum_i P_i x c_i`` with ``P_i`` the summed probability of
    expert i over the (local) tokens and ``c_i`` its token count (at the level of ``T``)."""
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff x mean over tokens of logsumexp(logits)^2``."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens an expert takes: ``ceil(num_tokens / experts x factor)`` (``num_tokens`` counts
    every (token, expert) choice, i.e. tokens x k)."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def sequence_major(x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Rows of ``x`` (tokens flattened batch-major, ``[b, s]``, plugtron's layout) reordered
    sequence-major (``[s, b]``, Megatron's): row ``j * b + i`` is position j of sequence i."""
    if batch_size == 1:
        return x
    return x.reshape(batch_size, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def batch_major(x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The inverse of :func:`sequence_major`."""
    if batch_size == 1:
        return x
    return x.reshape(-1, batch_size, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def apply_token_dropping(probs: torch.Tensor, routing_map: torch.Tensor, topk: int,
                         capacity_factor: float, drop_policy: str = "probs",
                         pad_to_capacity: bool = False,
                         batch_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop what exceeds each expert's capacity: ``probs`` keeps the highest-weight tokens,
    ``position`` the earliest. ``pad_to_capacity``: every expert takes exactly ``capacity``
    tokens (unrouted ones with weight 0).

    The rows are ``batch_size`` sequences flattened batch-major (``[b, s]``); they are ranked
    sequence-major, in Megatron's ``[s, b]`` order, so ``position`` keeps the earliest
    positions of every sequence (not the whole first sequence) and ties go as in Megatron's
    own layout. The returned tensors are in the input's (batch-major) order."""
    num_tokens, num_experts = probs.shape
    cap = capacity(num_tokens * topk, num_experts, capacity_factor)
    if cap > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            order = sequence_major(probs, batch_size)
        elif drop_policy == "position":
            # Earliest first, sequence-major: Megatron's top-k over the 0/1 map of its
            # [s, b] rows, with ties made explicit: routed rows before unrouted ones (the
            # padding), each in row order.
            rows = torch.arange(num_tokens, 0, -1, device=probs.device).unsqueeze(1)
            routed = sequence_major(routing_map, batch_size).long()
            order = routed * (num_tokens + 1) + rows
        else:
            raise ValueError(f"unknown drop policy {drop_policy!r}")
        indices = torch.topk(order, k=cap, dim=0, sorted=False).indices
        keep = batch_major(torch.zeros_like(probs).scatter(0, indices, 1).bool(), batch_size)
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                        rate: float) -> torch.Tensor:
    """``bias + rate x sign(mean(c) - c)``: under-used experts become more likely."""
    average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average - tokens_per_expert) * rate
