"""``allgather``: every rank gathers the tokens of its tp x ep peers, runs its own experts on
the ones routed to them, and reduce-scatters the weighted outputs back (Megatron's
MoEAllGatherTokenDispatcher). Simple and robust; moves every token to every ep rank."""

from __future__ import annotations

from plugtron.api import (
    all_gather_tensor,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from ..dispatcher import Dispatched, TokenDispatcher


class AllGatherDispatcher(TokenDispatcher):
    name = "allgather"

    def dispatch(self, hidden, probs, routing_map):
        x, p = self.enter_tp(hidden), self.enter_tp(probs)
        m = self.enter_tp(routing_map, differentiable=False)
        # Gather over ep: backward reduce-scatters, summing every ep rank's gradient.
        x = gather_from_sequence_parallel_region(x, self.ep_group, 0, True)
        p = gather_from_sequence_parallel_region(p, self.ep_group, 0, True)
        m = all_gather_tensor(m, self.ep_group, 0)
        rows, cols, counts = self.rows_by_expert(m, self.local_experts)
        return Dispatched(x.index_select(0, rows), counts, (rows, cols, p, m.shape[0]))

    def combine(self, expert_output, dispatched):
        rows, cols, p, num_rows = dispatched.state
        out = self.weighted_sum(rows, cols, p, expert_output, num_rows)
        out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group, 0)
        return self.exit_tp(out)


