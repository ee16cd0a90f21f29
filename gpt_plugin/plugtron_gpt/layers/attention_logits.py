"""The attention logits QK-clip (``--qk-clip``) records, for both attention layers here (the
grouped-query one and MLA).

Under context parallelism a rank holds two chunks of the sequence's queries and keys; its
queries attend to keys on every cp rank, so the keys are gathered over cp (no gradient: the
logits are only measured) and masked by their positions in the whole sequence. The maximum over
the cp ranks is the core's (``clip_qk`` reduces the maxima over dp x cp). Packed documents
(``--reset-attention-mask``) count only the pairs inside a document, the ones attention computes
(refused under cp, which cuts each document apart).
"""

from __future__ import annotations

import math

import torch
from plugtron.api import all_gather_tensor, current_forward_context, local_positions


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, query_positions: torch.Tensor | None = None,
               key_positions: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None,
               window_left: int | None = None) -> torch.Tensor:
    """The largest causal pre-softmax logit ``q . k / sqrt(d)`` of each head (``--qk-clip``);
    q ``[b, s, heads, d]`` and k ``[b, t, groups, d]``, heads grouped by query group. A key
    counts for a query at or after its position (default: both ``0..s-1``), at most
    ``window_left`` before it (``--window-size``) and, with ``document_ids`` (``[b, s]``,
    queries and keys the same tokens), in its document."""
    b, s, heads, d = q.shape
    groups = k.shape[2]
    scores = torch.einsum("bsgjd,btgd->bgjst", q.float().view(b, s, groups, heads // groups, d),
                          k.float()) / math.sqrt(d)
    if query_positions is None or key_positions is None:
        query_positions, key_positions = torch.arange(s), torch.arange(k.shape[1])
    behind = query_positions.to(q.device)[:, None] - key_positions.to(q.device)[None, :]
    hidden = behind < 0
    if window_left is not None:
        hidden = hidden | (behind > window_left)
    hidden = hidden[None, None, None]
    if document_ids is not None:
        other = document_ids[:, :, None] != document_ids[:, None, :]
        hidden = hidden | other.to(q.device)[:, None, None]
    return scores.masked_fill(hidden, float("-inf")).amax(dim=(0, 3, 4)).reshape(heads)


def layer_max_logits(q: torch.Tensor, k: torch.Tensor, parallel,
                     window: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`max_logits` of this rank's queries over every key of the sequence they attend
    to (``window``: ``--window-size``'s ``(left, 0)``): under context parallelism the keys of
    all cp ranks, gathered."""
    cp = parallel.cp_size
    left = None if window is None else window[0]
    if cp == 1:
        return max_logits(q, k, document_ids=current_forward_context().document_ids,
                          window_left=left)
    seq = q.shape[1] * cp
    keys = all_gather_tensor(k.detach().contiguous(), parallel.cp_group, dim=1)
    key_positions = torch.cat([local_positions(seq, rank, cp) for rank in range(cp)])
    return max_logits(q, keys, local_positions(seq, parallel.cp_rank, cp), key_positions,
                      window_left=left)
