"""The Mamba-2 SSD (state-space duality) scan in pure torch.

The recurrence, per head h with scalar decay ``A_h < 0`` and per-token step ``dt``::

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T      (S: [head_dim, state])
    y_t = S_t C_t

is computed chunk by chunk (Mamba-2 paper, section 6): inside a chunk of Q tokens it is one
masked matrix product (attention-like, ``C_i . B_j`` times the decay from j to i); between
chunks only the ``[head_dim, state]`` states are passed on. The cost is linear in the sequence.
A sequence that is not a multiple of Q is padded with ``dt = 0`` tokens (no decay, no input),
which changes nothing before them, so the result is exact for any length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _decay_matrix(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp(sum_{k=j+1..i} a_k)`` for ``i >= j``, 0 above the diagonal: ``[..., T, T]`` from
    ``a`` of ``[..., T]``. Each sum is its own cumulative sum down a column (not a difference
    of two long cumulative sums, which loses digits once they grow large), and the upper
    triangle is masked to -inf *before* the exp, so it can never become inf x 0 = nan."""
    length = log_decay.shape[-1]
    strictly_below = torch.ones(length, length, dtype=torch.bool,
                                device=log_decay.device).tril(-1)
    terms = log_decay[..., :, None].expand(*log_decay.shape, length)   # [..., k, j] = a_k
    sums = torch.cumsum(terms.masked_fill(~strictly_below, 0.0), dim=-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril()
    return sums.masked_fill(~causal, float("-inf")).exp()


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``y`` of the recurrence above from a zero initial state.

    ``x``: ``[b, l, heads, head_dim]``; ``dt``: ``[b, l, heads]`` (after softplus); ``A``:
    ``[heads]`` (negative); ``B``, ``C``: ``[b, l, groups, state]``, head h reading group
    ``h // (heads / groups)``. Returns ``[b, l, heads, head_dim]`` in ``x``'s dtype.

    Heads stay grouped (``g`` groups of ``r`` heads) so that ``C . B`` is computed once per
    group, not once per head, and every product is a two-operand einsum (no large
    intermediates from a three-way contraction order).
    """
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    per_group = heads // groups
    pad = (-length) % chunk_size
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks, q = x.shape[1] // chunk_size, chunk_size

    x = x.reshape(batch, chunks, q, groups, per_group, head_dim)
    dt = dt.reshape(batch, chunks, q, groups, per_group)
    B = B.reshape(batch, chunks, q, groups, state)
    C = C.reshape(batch, chunks, q, groups, state)
    x_dt = x * dt[..., None]                                      # the input term dt_j x_j
    log_decay = (dt * A.reshape(groups, per_group)).permute(0, 3, 4, 1, 2)  # [b, g, r, c, Q]
    cumulative = torch.cumsum(log_decay, dim=-1)

    # 1. Within each chunk: y_i = sum_{j<=i} (C_i . B_j) decay(j -> i) dt_j x_j.
    scores = torch.einsum("bclgn,bcsgn->bgcls", C, B)             # once per group
    scores = scores[:, :, None] * _decay_matrix(log_decay)         # [b, g, r, c, Q, Q]
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", scores, x_dt)

    # 2. Each chunk's final state from its own tokens: sum_j decay(j -> end) dt_j x_j B_j^T.
    to_end = torch.exp(cumulative[..., -1:] - cumulative)          # [b, g, r, c, Q]
    weighted = x_dt * to_end.permute(0, 3, 4, 1, 2)[..., None]
    states = torch.einsum("bclgn,bclgrp->bcgrpn", B, weighted)

    # 3. Pass states between chunks: the state entering chunk c sums the earlier chunks' states,
    #    each decayed over the chunks in between (a chunks x chunks decay matrix).
    chunk_decay = _decay_matrix(F.pad(cumulative[..., -1], (1, 0)))  # [b, g, r, c+1, c+1]
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    entering = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)[:, :-1]

    # 4. The entering state's contribution inside each chunk: C_i . S decayed to token i.
    from_start = torch.exp(cumulative).permute(0, 3, 4, 1, 2)      # [b, c, Q, g, r]
    y = y + torch.einsum("bclgn,bcgrpn->bclgrp", C, entering) * from_start[..., None]
    return y.reshape(batch, chunks * q, heads, head_dim)[:, :length]


def sequential_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor) -> torch.Tensor:
    """The same recurrence one token at a time: the reference :func:`ssd_scan` is tested
    against (slow; tests only)."""
    batch, length, heads, head_dim = x.shape
    groups = B.shape[2]
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    out = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[..., None, None]   # [b, h, 1, 1]
        update = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = decay * state + update
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(out, dim=1)


def ssd_final_state(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                    B: torch.Tensor) -> torch.Tensor:
    """The state ``S_L`` after the last token (from a zero state): what generation keeps to
    continue the recurrence token by token. ``[b, heads, head_dim, state]`` in fp32.

    ``S_L = sum_j exp(sum_{k>j} dt_k A) dt_j x_j B_j^T``; each decay sum is a reversed
    cumulative sum (no difference of two long sums)."""
    heads, groups = x.shape[2], B.shape[2]
    log_decay = dt * A                                              # [b, l, h]
    after = torch.flip(torch.cumsum(torch.flip(log_decay, [1]), dim=1), [1]) - log_decay
    weighted = x * (dt * after.exp())[..., None]                    # [b, l, h, p]
    B = B.repeat_interleave(heads // groups, dim=2)                 # [b, l, h, n]
    return torch.einsum("blhp,blhn->bhpn", weighted, B)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue the recurrence from ``state`` over the tokens of ``x`` (a few: generation's
    new ones), one at a time. Returns ``(y, new state)``; shapes as :func:`ssd_scan`."""
    heads, groups = x.shape[2], B.shape[2]
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    out = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(out, dim=1), state
