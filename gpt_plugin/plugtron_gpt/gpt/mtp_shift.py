"""Multi-token prediction's inputs shifted over the whole sequence, and its token counts over
the context-parallel ranks: what lets ``--mtp-num-layers`` run under ``--cp > 1`` as on one
process (the loss sums use ``sum_over_context_parallel``).

Depth k reads the tokens, labels and loss mask k places ahead (Megatron's ``roll_tensor``
applied k times: the vacated last places zero). Under cp a rank holds chunks r and 2cp-1-r of
each sample (of each document, for packed documents cut per document: ``chunk_order``), so the
places k ahead of a chunk's last tokens live on another rank. These are small integer and mask
tensors: they are gathered once per microbatch over the cp group, put back in sequence order,
and each depth indexes them at this rank's positions + k. Without cp the same indexing is a
plain shift (no collective).

The hidden states are not shifted: each depth's attention runs the model's own cp attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import (
    all_gather_tensor,
    all_reduce,
    chunk_order,
    group_rank,
    group_size,
    rank_positions,
)


class ShiftedInputs:
    """``tensors`` (each ``[b, local seq]``, this rank's share) shifted left over the whole
    sequence; :meth:`at` gives depth k's. ``document_ids``: the whole sequence's document
    numbers (packed documents), which say how the batch was split over cp."""

    def __init__(self, tensors: list[torch.Tensor], depth: int, cp_group, document_ids=None):
        cp, rank = group_size(cp_group), group_rank(cp_group)
        device = tensors[0].device
        self.dtypes = [t.dtype for t in tensors]
        seq = tensors[0].shape[1] * cp
        # One collective for all of them: float64 holds token ids and fp32 masks exactly.
        stacked = torch.stack([t.to(torch.float64) for t in tensors])  # [n, b, local]
        order = chunk_order(document_ids if cp > 1 else None, seq, cp, device)
        whole = stacked
        if cp > 1:
            gathered = all_gather_tensor(stacked, cp_group, dim=-1)  # rank order: r's 2 chunks
            ranked = torch.cat([rank_positions(order, r, cp) for r in range(cp)], dim=-1)
            whole = torch.empty_like(gathered)
            whole.scatter_(-1, ranked.expand_as(gathered), gathered)
        self.whole = F.pad(whole, (0, depth))  # the places past the end read 0
        self.mine = rank_positions(order, rank, cp)

    def at(self, k: int) -> list[torch.Tensor]:
        """The tensors shifted left ``k`` places, at this rank's positions."""
        index = (self.mine + k).expand(*self.whole.shape[:-1], self.mine.shape[-1])
        shifted = self.whole.gather(-1, index)
        return [x.to(dtype) for x, dtype in zip(shifted, self.dtypes)]


def count_over_cp(mask: torch.Tensor, cp_group) -> torch.Tensor:
    """The microbatch's count of ``mask`` over the whole sequence (no gradient)."""
    return all_reduce(mask.detach().sum(), cp_group)
