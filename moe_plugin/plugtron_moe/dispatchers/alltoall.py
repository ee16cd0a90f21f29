"""``alltoall``: permute tokens by expert, exchange per-expert counts, all-to-all over ep with
uneven splits, sort the received rows by local expert; combine reverses each step (Megatron's
MoEAlltoAllTokenDispatcher). Only routed tokens travel, and only to the ranks that need them.

Tensor parallelism: the tokens are first made the same on every tp rank (gathered over tp under
SP), so each tp rank exchanges the same rows with its ep peers and holds its slice of every
local expert; combine sums the partial outputs over tp.
"""

from __future__ import annotations

import torch
from plugtron.api import all_to_all, all_to_all_counts, group_size

from ..dispatcher import Dispatched, TokenDispatcher


class AllToAllDispatcher(TokenDispatcher):
    name = "alltoall"

    def dispatch(self, hidden, probs, routing_map):
        x, p = self.enter_tp(hidden), self.enter_tp(probs)
        m = self.enter_tp(routing_map, differentiable=False)
        ep, local = group_size(self.ep_group), len(self.local_experts)
        # Permute: rows grouped by global expert, so each destination's rows are contiguous.
        rows, cols, counts = self.rows_by_expert(m, range(self.num_experts))
        # On the tokens' device: nccl exchanges device tensors only (gloo takes either).
        send = torch.tensor(counts, dtype=torch.long, device=hidden.device).view(ep, local)
        recv = all_to_all_counts(send, self.ep_group)  # [source rank, local expert]
        input_splits, output_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = all_to_all(x.index_select(0, rows), self.ep_group, output_splits,
                              input_splits)
        # Received rows are [source][local expert]; the experts want [local expert][source].
        chunks = received.split(recv.flatten().tolist())
        by_expert = [chunks[s * local + e] for e in range(local) for s in range(ep)]
        tokens = torch.cat(by_expert) if by_expert else received
        state = (rows, cols, p, recv, input_splits, output_splits, m.shape[0])
        return Dispatched(tokens, recv.sum(0).tolist(), state)

    def combine(self, expert_output, dispatched):
        rows, cols, p, recv, input_splits, output_splits, num_rows = dispatched.state
        ep, local = recv.shape
        chunks = expert_output.split(recv.t().flatten().tolist())  # [local expert][source]
        by_source = [chunks[e * ep + s] for s in range(ep) for e in range(local)]
        back = torch.cat(by_source) if by_source else expert_output
        back = all_to_all(back, self.ep_group, input_splits, output_splits)
        return self.exit_tp(self.weighted_sum(rows, cols, p, back, num_rows))
