"""The attention logits QK-clip (``--qk-clip``) records, for both attention layers here (the
grouped-query one and MLA).

Under context parallelism a rank holds two chunks of the sequence's queries and keys; its
queries attend to keys on every cp rank, so the keys are gathered over cp (no gradient: the
logits are only measured) and masked by their positions in the whole sequence. The maximum over
the cp ranks is the core's (``clip_qk`` reduces the maxima over dp x cp). Packed documents
(``--reset-attention-mask``, or a dataset that packs) count only the pairs inside a document, the
ones attention computes; under cp each token's position comes from the split the batch had
(``plugtron.api.chunk_order``: each document cut in parts where the documents allow it).
"""

from __future__ import annotations

import math

import torch
from plugtron.api import all_gather_tensor, chunk_order, current_forward_context, rank_positions


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, query_positions: torch.Tensor | None = None,
               key_positions: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None,
               window_left: int | None = None,
               key_document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The largest causal pre-softmax logit ``q . k / sqrt(d)`` of each head (``--qk-clip``);
    q ``[b, s, heads, d]`` and k ``[b, t, groups, d]``, heads grouped by query group. A key
    counts for a query at or after its position (default: both ``0..s-1``; positions ``[s]``
    or, per sample, ``[b, s]``), at most ``window_left`` before it (``--window-size``) and,
    with ``document_ids`` (``[b, s]``, the queries'; the keys' are ``key_document_ids``, by
    default the same tokens'), in its document."""
    b, s, heads, d = q.shape
    groups = k.shape[2]
    scores = torch.einsum("bsgjd,btgd->bgjst", q.float().view(b, s, groups, heads // groups, d),
                          k.float()) / math.sqrt(d)
    if query_positions is None or key_positions is None:
        query_positions, key_positions = torch.arange(s), torch.arange(k.shape[1])
    behind = (query_positions.to(q.device)[..., :, None]
              - key_positions.to(q.device)[..., None, :])  # [s, t] or [b, s, t]
    hidden = behind < 0
    if window_left is not None:
        hidden = hidden | (behind > window_left)
    hidden = hidden[None, None, None] if hidden.dim() == 2 else hidden[:, None, None]
    if document_ids is not None:
        keys = document_ids if key_document_ids is None else key_document_ids
        other = document_ids[:, :, None] != keys[:, None, :]
        hidden = hidden | other.to(q.device)[:, None, None]
    return scores.masked_fill(hidden, float("-inf")).amax(dim=(0, 3, 4)).reshape(heads)


def layer_max_logits(q: torch.Tensor, k: torch.Tensor, parallel,
                     window: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`max_logits` of this rank's queries over every key of the sequence they attend
    to (``window``: ``--window-size``'s ``(left, 0)``): under context parallelism the keys of
    all cp ranks, gathered."""
    cp = parallel.cp_size
    left = None if window is None else window[0]
    documents = current_forward_context().document_ids
    if cp == 1:
        return max_logits(q, k, document_ids=documents, window_left=left)
    seq = q.shape[1] * cp
    keys = all_gather_tensor(k.detach().contiguous(), parallel.cp_group, dim=1)
    order = chunk_order(documents, seq, cp, q.device)
    key_positions = torch.cat([rank_positions(order, rank, cp) for rank in range(cp)], dim=-1)
    query_positions = rank_positions(order, parallel.cp_rank, cp)
    query_documents = key_documents = None
    if documents is not None:
        documents = documents.to(q.device)
        query_documents = documents.gather(1, query_positions)
        key_documents = documents.gather(1, key_positions)
    return max_logits(q, keys, query_positions, key_positions, query_documents, left,
                      key_documents)
