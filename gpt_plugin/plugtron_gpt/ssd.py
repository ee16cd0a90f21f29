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

from .ssd_intra import decay_matrix, intra_chunk


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``y`` of the recurrence above from a zero initial state.

    ``x``: ``[b, l, heads, head_dim]``; ``dt``: ``[b, l, heads]`` (after softplus); ``A``:
    ``[heads]`` (negative); ``B``, ``C``: ``[b, l, groups, state]``, head h reading group
    ``h // (heads / groups)``. Returns ``[b, l, heads, head_dim]`` in ``x``'s dtype.

    Everything runs in one layout, ``[b, c, g, r, Q, ...]`` (batch, chunk, group, head in the
    group, token in the chunk): the heads stay grouped so that ``C . B`` is computed once per
    group, not once per head, and each product is a batched matmul over matrices that are
    already contiguous (one permuting copy of ``x`` in, one of ``y`` out).
    """
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    per_group = heads // groups
    pad = (-length) % chunk_size
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks, q = x.shape[1] // chunk_size, chunk_size

    # [b, c, Q, g, r, p] -> [b, c, g, r, Q, p]; B, C: [b, c, Q, g, n] -> [b, c, g, Q, n].
    dt = dt.reshape(batch, chunks, q, groups, per_group).permute(0, 1, 3, 4, 2)
    x_dt = (x.reshape(batch, chunks, q, groups, per_group, head_dim).permute(0, 1, 3, 4, 2, 5)
            * dt[..., None]).contiguous()                         # the input term dt_j x_j
    B = B.reshape(batch, chunks, q, groups, state).transpose(2, 3).contiguous()
    C = C.reshape(batch, chunks, q, groups, state).transpose(2, 3).contiguous()
    log_decay = dt * A.reshape(groups, per_group, 1)               # [b, c, g, r, Q]
    cumulative = torch.cumsum(log_decay, dim=-1)

    # 1. Within each chunk: y_i = sum_{j<=i} (C_i . B_j) decay(j -> i) dt_j x_j.
    y = intra_chunk(C, B, x_dt, log_decay)

    # 2. Each chunk's final state from its own tokens: sum_j decay(j -> end) dt_j x_j B_j^T.
    to_end = torch.exp(cumulative[..., -1:] - cumulative)          # [b, c, g, r, Q]
    states = torch.matmul((x_dt * to_end[..., None]).transpose(-1, -2),
                          B.unsqueeze(3))                          # [b, c, g, r, p, n]

    # 3. Pass states between chunks: the state entering chunk c sums the earlier chunks' states,
    #    each decayed over the chunks in between (a chunks x chunks decay matrix; the chunks are
    #    few, so this is one small batched matmul rather than a loop).
    totals = cumulative[..., -1].permute(0, 2, 3, 1)               # [b, g, r, c]
    chunk_decay = decay_matrix(F.pad(totals, (1, 0)))[..., :-1, 1:]  # [b, g, r, c, c]
    flat = states.permute(0, 2, 3, 1, 4, 5).reshape(batch, groups, per_group, chunks, -1)
    entering = torch.matmul(chunk_decay, flat)                     # [b, g, r, c, p*n]
    entering = entering.reshape(batch, groups, per_group, chunks, head_dim, state)
    entering = entering.permute(0, 3, 1, 2, 4, 5)                  # [b, c, g, r, p, n]

    # 4. The entering state's contribution inside each chunk: C_i . S decayed to token i.
    y = y + torch.matmul(C.unsqueeze(3), entering.transpose(-1, -2)) \
        * torch.exp(cumulative)[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(batch, chunks * q, heads, head_dim)
    return y[:, :length]


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
