"""Causal attention over packed documents on CPU, each document on its own.

One masked kernel over the whole sequence computes every score and masks most of them away:
1.7-1.9x the time of causal attention at 2048 tokens. The flash kernel run on the documents
alone does only their own work (the sum of their squares, not the square of their sum).
A document of ``LONG_DOCUMENT`` tokens or more runs alone on views of its tokens. Shorter ones,
where a kernel call per document would cost more than it saves, run in batches of similar length
(:func:`_buckets`): each is copied into a row of a zero-padded ``[n, heads, L, d]`` block, ``L``
its length rounded up to a quarter of its power of two (at most 25% longer), and the padding is
exact: padded keys come after every real query (the causal mask hides them), padded queries are
dropped, and in backward their zero gradient, output and query give them no gradient to spread.
One autograd function around it, so that what backward keeps is what causal flash attention
keeps (q, k, v, the output and its log-sum-exp, each once), which the memory estimate counts.

With attention dropout (which the CPU flash kernel does not draw),
:func:`per_document_dropout_attention` runs the same padded batches, every document's, through
torch's attention with dropout under autograd: each batch keeps its probabilities for backward,
``n x L x L`` per head instead of the whole sequence's ``s x s``.
"""

from __future__ import annotations

import torch

#: Bucket lengths are multiples of a quarter of the length's power of two, and of this.
MIN_GRANULE = 8
#: Documents this long run alone (the copies into a padded batch would cost more than a call).
LONG_DOCUMENT = 128


def applies(q: torch.Tensor, dropout_p: float, runs: list[list[tuple[int, int]]]) -> bool:
    """On CPU without attention dropout (the CPU flash kernel draws none), in fp32, bf16 or fp16:
    where this path is exact and pays. ``runs``: ``plugtron.api.document_runs``."""
    return (q.device.type == "cpu" and dropout_p == 0.0
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16))


def applies_with_dropout(q: torch.Tensor, dropout_p: float) -> bool:
    """On CPU with attention dropout: :func:`per_document_dropout_attention`."""
    return q.device.type == "cpu" and dropout_p > 0.0


def _padded_length(length: int) -> int:
    granule = max(MIN_GRANULE, (1 << (length.bit_length() - 1)) // 4)
    return -(-length // granule) * granule


def _long(runs: list[list[tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of the documents that run alone."""
    return [(row, a, e) for row, spans in enumerate(runs) for a, e in spans
            if e - a >= LONG_DOCUMENT]


def _buckets(runs: list[list[tuple[int, int]]], seq: int, longest: int = LONG_DOCUMENT):
    """``[(L, index)]``: the documents shorter than ``longest`` padded to length ``L`` as rows
    of ``index`` ``[n, L]``, positions into the flattened ``[b * seq]`` tokens, ``b * seq`` (a
    zero row) for padding."""
    groups: dict[int, list[torch.Tensor]] = {}
    for row, spans in enumerate(runs):
        for a, e in spans:
            if e - a >= longest:
                continue
            length = _padded_length(e - a)
            index = torch.full((length,), len(runs) * seq, dtype=torch.long)
            index[:e - a] = torch.arange(row * seq + a, row * seq + e)
            groups.setdefault(length, []).append(index)
    return [(length, torch.stack(rows)) for length, rows in sorted(groups.items())]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[b, h, s, ...]`` -> token-first ``[b * s + 1, h, ...]`` with a zero last token (the
    padding)."""
    tokens = t.transpose(1, 2)
    flat = tokens.reshape(t.shape[0] * t.shape[2], *tokens.shape[2:])
    return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])


def _gather(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``index`` ``[n, L]`` from token-first ``[tokens, h, ...]`` -> ``[n, h, L, ...]``."""
    return flat[index].transpose(1, 2).contiguous()


def _scatter(into: torch.Tensor, block: torch.Tensor, index: torch.Tensor, tokens: int) -> None:
    """``block`` ``[n, h, L, ...]`` back into token-first ``into``, padding dropped."""
    real = index < tokens
    into[index[real]] = block.transpose(1, 2)[real]


def _token_first(b: int, s: int, heads: int, *rest: int, like: torch.Tensor,
                 dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[b * s, heads, ...]`` storage, its ``[b, heads, s, ...]`` view): a result laid out
    token-first as torch's flash kernel lays its output, so that ``transpose(1, 2).reshape``
    to ``[b, s, heads * d]`` is free (the next linear then keeps the same storage)."""
    flat = like.new_empty(b * s, heads, *rest, dtype=dtype)
    return flat, flat.view(b, s, heads, *rest).transpose(1, 2)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


class _PerDocument(torch.autograd.Function):
    """q ``[b, heads, s, d]``, k/v ``[b, groups, s, d]`` -> ``[b, heads, s, d_v]``."""

    @staticmethod
    def forward(ctx, q, k, v, runs):
        b, heads, s = q.shape[:3]
        tokens = b * s
        k_e, v_e = _expand(k, heads), _expand(v, heads)
        out_flat, out = _token_first(b, s, heads, v.shape[-1], like=q)
        lse_flat, lse = _token_first(b, s, heads, like=q, dtype=torch.float32)  # kernels' fp32
        buckets = _buckets(runs, s)
        if buckets:
            qf, kf, vf = (_flat(t) for t in (q, k_e, v_e))
            for _, index in buckets:
                o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    _gather(qf, index), _gather(kf, index), _gather(vf, index), 0.0, True)
                _scatter(out_flat, o, index, tokens)
                _scatter(lse_flat, m, index, tokens)
        for row, a, e in _long(runs):
            part = (slice(row, row + 1), slice(None), slice(a, e))
            out[part], lse[part] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[part], k_e[part], v_e[part], 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.buckets, ctx.long = buckets, _long(runs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        b, heads, s = q.shape[:3]
        tokens = b * s
        k_e, v_e = _expand(k, heads), _expand(v, heads)
        grads = [_token_first(b, s, heads, t.shape[-1], like=q) for t in (q, k, v)]
        if ctx.buckets:
            flat = [_flat(t) for t in (grad_out, q, k_e, v_e, out, lse)]
            for _, index in ctx.buckets:
                blocks = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    *(_gather(t, index) for t in flat), 0.0, True)
                for (into, _), block in zip(grads, blocks):
                    _scatter(into, block, index, tokens)
        dq, dk, dv = (view for _, view in grads)
        for row, a, e in ctx.long:
            part = (slice(row, row + 1), slice(None), slice(a, e))
            dq[part], dk[part], dv[part] = \
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad_out[part], q[part], k_e[part], v_e[part], out[part], lse[part],
                    0.0, True)
        if k.shape[1] != heads:  # grouped queries: each group's heads' gradients summed
            groups = k.shape[1]
            dk = dk.reshape(b, groups, heads // groups, s, dk.shape[-1]).sum(2)
            dv = dv.reshape(b, groups, heads // groups, s, dv.shape[-1]).sum(2)
        return dq, dk, dv, None


def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           runs: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Causal attention of each run of ``runs`` (:func:`document_runs`) alone; shapes as
    :class:`_PerDocument`. Use where :func:`applies`."""
    return _PerDocument.apply(q, k, v, runs)


def per_document_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   runs: list[list[tuple[int, int]]],
                                   dropout_p: float) -> torch.Tensor:
    """Causal attention with dropout of each run alone, through autograd; shapes as
    :class:`_PerDocument`. The dropout masks come from the current random stream."""
    b, heads, s = q.shape[:3]
    tokens = b * s
    out = q.new_zeros(tokens + 1, heads, v.shape[-1])  # token-first for index_put
    for _, index in _buckets(runs, s, longest=s + 1):
        q_b, k_b, v_b = (_flat(t)[index].transpose(1, 2) for t in (q, k, v))
        block = torch.nn.functional.scaled_dot_product_attention(
            q_b, k_b, v_b, is_causal=True,
            dropout_p=dropout_p, enable_gqa=k.shape[1] != heads)  # [n, heads, L, d_v]
        # padding rows all land on the dropped last token
        out = out.index_put((index.reshape(-1),), block.transpose(1, 2).reshape(-1, heads,
                                                                                 v.shape[-1]))
    return out[:tokens].view(b, s, heads, -1).transpose(1, 2)
