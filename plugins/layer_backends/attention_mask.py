"""The boolean attention mask of core attention, built in one place so that every rule that
narrows what a query may see (causality, packed documents, a sliding window) composes
here instead of in each backend's forward.
"""

from __future__ import annotations

import torch


def causal_mask(q_len: int, k_len: int, document_ids: torch.Tensor | None = None,
                device=None) -> torch.Tensor:
    """``True`` where a query may attend a key: ``[1, 1, q, k]``, or ``[b, 1, q, k]`` with
    ``document_ids``.

    The queries are the last ``q_len`` of the ``k_len`` positions (all of them in training; the
    new tokens of a generation step), so query ``i`` sits at position ``k_len - q_len + i`` and
    sees keys at positions up to its own. ``document_ids`` (``[b, k_len]``, Megatron's
    ``--reset-attention-mask`` as the document number of each token) further keeps only the keys
    of the query's own document.
    """
    if document_ids is not None:
        device = document_ids.device
    offset = k_len - q_len
    query_pos = torch.arange(offset, k_len, device=device)
    key_pos = torch.arange(k_len, device=device)
    mask = (key_pos[None, :] <= query_pos[:, None])[None, None]
    if document_ids is None:
        return mask
    if document_ids.shape[-1] != k_len:
        raise ValueError(f"document_ids cover {document_ids.shape[-1]} positions, the keys "
                         f"{k_len}")
    same = document_ids[:, offset:, None] == document_ids[:, None, :]  # [b, q, k]
    return mask & same[:, None]


def attention_mask(q_len: int, k_len: int, *, document_ids: torch.Tensor | None = None,
                   window: tuple[int, int] | None = None, device=None) -> torch.Tensor | None:
    """The mask core attention needs, or ``None`` where plain causal attention (``is_causal``,
    the fast path) is exact. ``window`` ``(left, 0)``: a query at position i sees keys
    i-left..i (Megatron's and TE's ``--window-size`` convention); a window covering every
    earlier key changes nothing."""
    windowed = window is not None and window[0] < k_len - 1
    if document_ids is None and not windowed:
        return None
    mask = causal_mask(q_len, k_len, document_ids, device)
    if window is not None and windowed:
        query_pos = torch.arange(k_len - q_len, k_len, device=mask.device)[:, None]
        key_pos = torch.arange(k_len, device=mask.device)[None, :]
        mask = mask & (query_pos - key_pos <= window[0])
    return mask
