"""Bytes the Mamba layer ``M`` keeps for backward for one microbatch (its ``activation_bytes``),
in the notation of the shared layers' accounting (layers/activations.py)."""

from __future__ import annotations

from plugtron_gpt.hybrid.options import CONV_WIDTH
from plugtron_gpt.layers.activations import norm_bytes


def mamba_layer_bytes(layer, shape) -> int:
    """``M``: norm, in_proj input and output, the conv's padded input and pre-activation, the
    chunked SSD scan
    (fp32, over the sequence padded to whole chunks: the ``[chunk, chunk]`` score and decay
    matrices per head, the per-chunk states, the token-sized terms), gated norm, out_proj
    input, residual dropout. Approximate: the scan's intermediates are counted by kind, not
    one by one (tests/core/tools/test_memory_estimate.py holds it within 10% of autograd's)."""
    mixer = layer.mixer
    h = mixer.in_proj.weight.shape[1]
    heads, p, n, q = mixer.heads, mixer.head_dim, mixer.state, mixer.chunk_size
    inner, bc = mixer.inner, mixer.groups * mixer.state
    total = norm_bytes(shape, h, layer.normalization) + shape.residual(h)
    total += shape.tensor(2 * inner + 2 * bc + heads)  # in_proj output (conv reads a view)
    b, s = shape.micro_batch_size, shape.seq_length
    # the fused conv + SiLU keeps its left-padded input and the pre-activation output
    conv = shape.tensor(inner + 2 * bc)
    total += conv * (s + CONV_WIDTH - 1) // s + conv
    padded = -(-s // q) * q
    chunks = padded // q
    groups, tokens = mixer.groups, 4 * b * padded  # the scan keeps fp32 over whole chunks
    # ssd_chunked.py: per group C . B; per head the decay matrix, [L * G | e C], x and
    # [dt x ; entering state], w B, the two decays; B, C re-laid out (dt is the softplus's
    # output, counted there); per chunk each head's own state.
    total += tokens * (groups * q + heads * (2 * q + n) + 2 * heads * p + heads * n
                       + 2 * heads + 2 * bc)
    total += 4 * b * chunks * heads * 2 * n * p
    total += 3 * shape.tensor(inner, 4) + shape.tensor(inner)  # gated norm, out_proj input
    return total + shape.dropout_mask(h, layer.hidden_dropout)
