"""Attention of some query rows against a block of keys, with log-sum-exp: the piece that ring and
all-gather context-parallel attention merge across blocks (online softmax).

Everything is in fp32 with plain matmuls, addressed by *positions*: ``q_pos`` and ``k_pos`` are
the true sequence positions of the query rows and key rows, so the causal mask (key after query)
and the dropout mask are the same whichever rank, block or tile a pair lands in. Positions are
``[rows]`` (every sample alike) or ``[b, rows]`` (each sample its own: packed documents split
per document over cp, :mod:`plugtron.core.parallel.cp_layout`).

* :func:`block_forward` returns the block's output and the log-sum-exp of its scores per row;
  the caller merges blocks with ``logaddexp``.
* :func:`block_backward` is the flash-attention backward of one block, given the *final* output,
  its log-sum-exp and ``delta = rowsum(grad_out * out)``: nothing of the forward's score matrix
  has to be kept, it is recomputed.
* Rows are processed in tiles so that no score matrix above :data:`TILE_ELEMENTS` exists at once
  (the transient memory stays bounded for long sequences).
* Attention dropout: whether the probability of (sample, head, query position, key position) is
  kept is a hash of a per-call seed and those four numbers (:func:`keep_mask`). Backward
  regenerates exactly the forward's mask for any tiling without storing it, and the mask of the
  whole sequence is one i.i.d. Bernoulli draw however it is split over cp ranks. It is not the
  mask torch's fused dropout would draw for one process (a different generator), but the same
  distribution.

Shapes: q ``[b, heads, sq, d]``, k and v ``[b, groups, sk, d]`` (``heads`` a multiple of
``groups``, grouped-query attention with heads laid out group-major).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Most score-matrix elements alive at once (fp32: 4 MiB); rows are tiled to stay below it.
TILE_ELEMENTS = 1 << 20

# splitmix64's finalizer constants as signed int64 (torch has no full uint64 arithmetic).
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


@dataclass(frozen=True)
class Dropout:
    """Attention dropout of one call: probability ``p`` of dropping, ``seed`` of its mask."""

    p: float
    seed: int


def draw_dropout(p: float, device) -> Dropout | None:
    """A :class:`Dropout` whose seed is drawn from the current random stream of ``device`` (the
    layer's dropout stream, so the draw advances it as torch's dropout would); None for p 0."""
    if not p:
        return None
    seed = int(torch.randint(0, 1 << 62, (1,), device=device).item())
    return Dropout(p, seed)


def _shift(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (torch's ``>>`` is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijective scramble of 64 bits (integer products wrap)."""
    z = (z ^ _shift(z, 30)) * _MUL1
    z = (z ^ _shift(z, 27)) * _MUL2
    return z ^ _shift(z, 31)


def keep_mask(dropout: Dropout, batch: int, heads: int, q_pos: torch.Tensor,
              k_pos: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, len(q_pos), len(k_pos)]`` booleans: True where the probability is kept
    (probability ``1 - p``), a pure function of the seed and the four indices."""
    device = q_pos.device
    lanes = torch.arange(batch * heads, dtype=torch.int64, device=device).view(batch, heads, 1, 1)
    q_pos, k_pos = q_pos.to(torch.int64), k_pos.to(torch.int64)
    rows = _mix((lanes << 32) + q_pos.view(-1, 1, q_pos.shape[-1], 1) + dropout.seed)
    bits = _mix(rows + k_pos.view(-1, 1, 1, k_pos.shape[-1]) * _GOLDEN)
    return _shift(bits, 33) >= int(round(dropout.p * (1 << 31)))


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V groups repeated to one per query head ``[b, groups, s, d] -> [b, heads, s, d]``."""
    groups = x.shape[1]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of :func:`_expand`: the heads of one group summed."""
    b, heads, s, d = grad.shape
    if heads == groups:
        return grad
    return grad.view(b, groups, heads // groups, s, d).sum(2)


def _rows(doc, rows):
    return None if doc is None else doc[:, rows]


def _at(pos: torch.Tensor, rows) -> torch.Tensor:
    """Positions of some rows: ``[rows]`` or, per sample, ``[b, rows]``."""
    return pos[..., rows]


def _later(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """True where the key comes after the query, broadcastable to the scores ``[b, h, q, k]``."""
    later = k_pos[..., None, :] > q_pos[..., :, None]
    return later if later.dim() == 2 else later[:, None]


def _row_tiles(q: torch.Tensor, sk: int):
    b, heads, sq = q.shape[:3]
    step = max(1, TILE_ELEMENTS // max(1, b * heads * sk))
    return [slice(i, min(i + step, sq)) for i in range(0, sq, step)]


def _probs(q, k_e, lse, q_pos, k_pos, scale, causal, q_doc=None, k_doc=None):
    """Softmax probabilities of the rows of ``q`` given their (final or own) log-sum-exp, or
    their own log-sum-exp when ``lse`` is None. In place on the one score matrix of the tile
    (these kernels run outside autograd): each out-of-place step would add a tile-sized
    temporary to the transient peak. ``q_doc``/``k_doc`` (``[b, rows]``, ``[b, keys]``):
    document numbers, a row seeing only keys of its own document; a row that sees no key of
    this block gets probabilities 0 and a log-sum-exp of -inf."""
    scores = torch.matmul(q, k_e.transpose(-1, -2)).mul_(scale)
    if causal:
        scores.masked_fill_(_later(q_pos, k_pos), float("-inf"))
    if q_doc is not None:
        scores.masked_fill_((q_doc[:, :, None] != k_doc[:, None, :])[:, None], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
        if q_doc is not None:  # rows without a key here: exp(-inf - 0) = 0, not NaN
            return scores.sub_(lse.nan_to_num(neginf=0.0)[..., None]).exp_(), lse
    return scores.sub_(lse[..., None]).exp_(), lse


def block_forward(q, k, v, q_pos, k_pos, scale: float, causal: bool,
                  dropout: Dropout | None = None, q_doc=None, k_doc=None):
    """(output ``[b, heads, sq, d]``, log-sum-exp ``[b, heads, sq]``) of the rows of ``q``
    against this block of keys alone (fp32). Without document numbers every row must see at
    least one key; with them (``q_doc``, ``k_doc``) a row that sees none gives 0 and -inf."""
    b, heads, sq, d = q.shape
    k_e, v_e = _expand(k.float(), heads), _expand(v.float(), heads)
    out = torch.empty(b, heads, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(b, heads, sq, dtype=torch.float32, device=q.device)
    for rows in _row_tiles(q, k.shape[2]):
        probs, lse[:, :, rows] = _probs(q[:, :, rows].float(), k_e, None, _at(q_pos, rows),
                                        k_pos, scale, causal, _rows(q_doc, rows), k_doc)
        if dropout is not None:
            keep = keep_mask(dropout, b, heads, _at(q_pos, rows), k_pos)
            probs.mul_(keep).div_(1.0 - dropout.p)
        out[:, :, rows] = torch.matmul(probs, v_e)
    return out, lse


def block_backward(q, k, v, out, lse, grad_out, q_pos, k_pos, scale: float, causal: bool,
                   dropout: Dropout | None = None, q_doc=None, k_doc=None):
    """(dq, dk, dv) of one block (fp32; dk and dv per group, shaped like k and v), given the
    final ``out`` and ``lse`` of these query rows over all blocks."""
    b, heads, sq, d = q.shape
    groups = k.shape[1]
    k_e, v_e = _expand(k.float(), heads), _expand(v.float(), heads)
    grad_q = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    grad_k = torch.zeros(k_e.shape, dtype=torch.float32, device=q.device)
    grad_v = torch.zeros(v_e.shape, dtype=torch.float32, device=q.device)
    for rows in _row_tiles(q, k.shape[2]):
        q_t, go = q[:, :, rows].float(), grad_out[:, :, rows].float()
        delta = (go * out[:, :, rows].float()).sum(-1)
        probs, _ = _probs(q_t, k_e, lse[:, :, rows], _at(q_pos, rows), k_pos, scale, causal,
                          _rows(q_doc, rows), k_doc)
        grad_probs = torch.matmul(go, v_e.transpose(-1, -2))
        if dropout is not None:  # out = (P * keep / (1-p)) V: the mask scales both products
            keep = keep_mask(dropout, b, heads, _at(q_pos, rows), k_pos) / (1.0 - dropout.p)
            grad_probs = grad_probs * keep
            grad_v += torch.matmul((probs * keep).transpose(-1, -2), go)
        else:
            grad_v += torch.matmul(probs.transpose(-1, -2), go)
        grad_scores = grad_probs.sub_(delta[..., None]).mul_(probs)  # in place, as _probs
        del grad_probs
        grad_q[:, :, rows] = torch.matmul(grad_scores, k_e) * scale
        grad_k += torch.matmul(grad_scores.transpose(-1, -2), q_t) * scale
    return grad_q, _fold(grad_k, groups), _fold(grad_v, groups)
