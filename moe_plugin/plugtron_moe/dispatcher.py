"""The token dispatcher contract: the swappable part of the MoE layer.

A dispatcher moves each token to the ranks holding the experts the router chose for it and
back. It is found by name in the entry-point group ``plugtron.moe_dispatchers`` and selected
with ``--moe-token-dispatcher-type NAME``; a third party ships one as its own package::

    # setup.cfg of plugtron-mydispatch
    [options.entry_points]
    plugtron.moe_dispatchers =
        mine = mydispatch:MyDispatcher

    # mydispatch.py
    from plugtron_moe import Dispatched, TokenDispatcher

    class MyDispatcher(TokenDispatcher):
        def dispatch(self, hidden, probs, routing_map): ...
        def combine(self, expert_output, dispatched): ...

The MoE layer calls, for every microbatch, ``dispatch`` then the experts then ``combine``:

* ``dispatch(hidden [T, H], probs [T, E], routing_map [T, E] bool) -> Dispatched``: ``hidden``
  are this rank's tokens (this tp rank's sequence shard under sequence parallelism), ``probs``
  the routing weights (0 where not routed), ``routing_map`` the routed (token, expert) pairs
  after capacity dropping/padding. Returns the rows for this rank's experts sorted by local
  expert (``tokens``, ``[sum(tokens_per_expert), H]``), their count per local expert
  (``tokens_per_expert``, in :attr:`local_experts` order) and whatever combine needs.
* ``combine(expert_output, dispatched) -> [T, H]``: ``expert_output`` is the experts' output
  for ``dispatched.tokens``, row for row, and is a *partial sum over expert tensor parallelism*
  (each etp rank holds a slice of every local expert). Returns, for this rank's tokens, the sum
  over the token's experts of ``prob x output``, reduced over etp (and back to this rank's
  sequence shard under SP).

Both must be differentiable (use the autograd collectives of ``plugtron.api``: ``all_to_all``,
``gather_from_sequence_parallel_region``, ...), and every rank of the expert-parallel group
calls them the same number of times (they are collectives). Tensors handed to a collective
(per-expert counts too) live on ``hidden.device``: nccl takes device tensors only.
:meth:`enter_tp` / :meth:`exit_tp`
are the tensor-parallel boundary every dispatcher needs: after ``enter_tp`` the rows are the
same on every rank of the etp group (which holds slices of the same experts) and different
across the ep group, whatever tp, etp and sequence parallelism are; ``exit_tp`` undoes it.
A dispatcher written with them is correct for any ``--expert-tensor-parallel-size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from plugtron.api import (
    all_gather_tensor,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    group_size,
    load_plugin,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

from .weighted_combine import weighted_row_sum


@dataclass
class Dispatched:
    """What ``dispatch`` hands the experts: ``tokens`` sorted by local expert,
    ``tokens_per_expert`` (one int per local expert), and ``state`` for ``combine``."""

    tokens: torch.Tensor
    tokens_per_expert: list[int]
    state: Any = None


class TokenDispatcher:
    """Base class of token dispatchers (public API of plugtron-moe).

    Built once per MoE layer with ``(config, parallel, num_experts, local_experts)``:
    ``parallel`` is the run's ``ParallelContext`` (``ep_group``, ``tp_group``, ...),
    ``local_experts`` the global ids of this rank's experts (a contiguous block; ep rank r
    holds ``r*E/ep .. (r+1)*E/ep - 1``). A dispatcher may declare its own options with a
    ``plugtron_config_sections`` staticmethod, like any plugin.
    """

    #: the entry-point name, for messages
    name = "abstract"

    def __init__(self, config, parallel, num_experts: int, local_experts: list[int]):
        self.config, self.parallel = config, parallel
        self.num_experts, self.local_experts = num_experts, list(local_experts)
        self.sequence_parallel = bool(config.parallel.sequence_parallel) and parallel.tp_size > 1
        self.tp_group, self.ep_group = parallel.tp_group, parallel.ep_group
        self.etp_group = parallel.etp_group
        # Without SP the tp ranks hold the same tokens. With etp = tp they are then already the
        # same on the etp group; otherwise each tp rank takes its share of them (so no token is
        # computed twice) and the outputs are gathered back over tp on exit.
        replicated = parallel.tp_size > 1 and not self.sequence_parallel
        self.tokens_shared_by_etp = replicated and parallel.etp_size == parallel.tp_size
        self.split_over_tp = replicated and parallel.etp_size != parallel.tp_size

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        raise NotImplementedError

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers

    def enter_tp(self, x: torch.Tensor, differentiable: bool = True) -> torch.Tensor:
        """Make ``x`` (rows = tokens) the same on every rank of the expert tensor-parallel
        group: gathered over etp when its ranks hold different tokens (SP, or etp != tp),
        as it is when they hold the same (etp = tp without SP). Backward sums the etp ranks'
        partial gradients."""
        if self.split_over_tp:  # replicated over tp: keep this tp rank's share of the rows
            x = (scatter_to_sequence_parallel_region(x, self.tp_group, 0) if differentiable
                 else x.chunk(group_size(self.tp_group))[self.parallel.tp_rank])
        if group_size(self.etp_group) == 1:
            return x
        if self.tokens_shared_by_etp:
            return copy_to_tensor_parallel_region(x, self.etp_group) if differentiable else x
        if not differentiable:
            return all_gather_tensor(x, self.etp_group, 0)
        return gather_from_sequence_parallel_region(x, self.etp_group, 0, True)

    def exit_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial outputs over etp, back to this rank's rows (its sequence shard under SP;
        all the tp group's tokens without SP)."""
        if group_size(self.etp_group) > 1:
            x = (reduce_from_tensor_parallel_region(x, self.etp_group)
                 if self.tokens_shared_by_etp
                 else reduce_scatter_to_sequence_parallel_region(x, self.etp_group, 0))
        if self.split_over_tp:
            # Every tp rank continues with the same (replicated) gradient: backward keeps this
            # rank's rows only.
            x = gather_from_sequence_parallel_region(x, self.tp_group, 0, False)
        return x

    def rows_by_expert(self, routing_map: torch.Tensor, experts) -> tuple[torch.Tensor,
                                                                          torch.Tensor,
                                                                          list[int]]:
        """``(token rows, expert ids, counts)`` of the routed pairs of ``experts``, expert by
        expert, tokens in order within each (Megatron's permutation order)."""
        ids = torch.as_tensor(list(experts), device=routing_map.device)
        # one nonzero over the [experts, tokens] map lists the pairs expert-major, tokens in
        # order: the per-expert loop's order, in one pass
        picked, rows = routing_map.index_select(1, ids).t().nonzero(as_tuple=True)
        counts = torch.bincount(picked, minlength=len(ids)).tolist()
        return rows, ids[picked], counts

    @staticmethod
    def weighted_sum(rows: torch.Tensor, cols: torch.Tensor, probs: torch.Tensor,
                     output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``out[t] = sum over pairs (t, e) of probs[t, e] x output[pair]``."""
        return weighted_row_sum(output, probs[rows, cols].to(output.dtype), rows, num_tokens)


def load_dispatcher(name: str) -> type:
    """The dispatcher class registered under ``name`` (``PluginError`` lists the others)."""

    return load_plugin("moe_dispatcher", name)
