"""Bytes the GPT plugin's layers keep for backward for one microbatch (the ``activation_bytes``
contract of ``plugtron.api.ActivationShape``), written from what the local backend's kernels
save; tests/core/tools/test_memory_estimate.py holds them to autograd's saved tensors.

Notation: ``shape.residual(w)`` a residual-stream tensor (split over tp under sequence
parallelism), ``shape.tensor(w)`` a tensor of this rank's tp share ``w``.
"""

from __future__ import annotations

#: LayerNorm keeps mean and 1/std per token, RMSNorm 1/rms (fp32).
_NORM_STATS = {"LayerNorm": 2, "RMSNorm": 1}


def norm_bytes(shape, width: int, normalization: str, recomputed: bool = False) -> int:
    """A norm's input (kept either way: a recomputed norm keeps it as the recompute's input)
    and, unless recomputed, its per-token statistics. torch's CPU RMSNorm is composite: it
    keeps an fp32 copy of the input and the normalized input (for the weight's gradient), both
    fp32 whatever the dtype."""
    if recomputed:
        return shape.residual(width)
    stats = shape.residual(_NORM_STATS.get(normalization, 2), 4)
    if normalization == "RMSNorm" and not shape.cuda:
        return 2 * shape.residual(width, 4) + stats
    return shape.residual(width) + stats


def math_attention(shape, heads: int, head_dim: int, dropout: float,
                   kernel_bytes: int | None = None) -> int:
    """torch's math kernel (CPU with dropout or a mask): q, k, v (keys repeated per query head),
    the probabilities, and with dropout the mask and the dropped probabilities, all in
    ``kernel_bytes`` per element (the activations' own unless the kernel runs in fp32)."""
    e = shape.dtype_bytes if kernel_bytes is None else kernel_bytes
    scores = shape.micro_batch_size * heads * shape.seq_length * shape.context_length
    kept = 3 * shape.tensor(heads * head_dim, e) + scores * e
    if dropout > 0:
        # CUDA keeps bool masks; CPU masks of the dtype the kernel computes in
        kept += scores * ((shape.mask_bytes if shape.cuda else e) + e)
    return kept


def fused_attention(shape, heads: int, groups: int, head_dim: int,
                    kernel_bytes: int | None = None) -> int:
    """Flash/fused kernels: q, k, v, the output (the output projection's input, the same
    tensor) and the fp32 log-sum-exp per query. A kernel run in fp32 on half activations keeps
    fp32 copies of q, k, v and its fp32 output; the output projection keeps the cast back."""
    e = shape.dtype_bytes if kernel_bytes is None else kernel_bytes
    kept = (shape.tensor((heads + 2 * groups) * head_dim, e) + shape.tensor(heads * head_dim, e)
            + shape.tensor(heads, 4))
    if e != shape.dtype_bytes:
        kept += shape.tensor(heads * head_dim)
    return kept


def mla_layer_bytes(layer, shape) -> int:
    """``*`` with multi-latent attention, approximately: norm, the down-projections' input,
    the latents (norm inputs and statistics, up-projection inputs), the rotary parts, core
    attention over the expanded q, k (both ``qk + pos`` wide) and v, output projection input,
    residual dropout (tests/core/tools/test_memory_estimate.py holds it within 5% of autograd's saved
    tensors)."""
    attn = layer.self_attention
    h = attn.linear_kv_down_proj.weight.shape[1]
    heads, qd, vd, pos = attn.num_heads, attn.q_head_dim, attn.v_head_dim, attn.pos_dim
    stats = _NORM_STATS.get(layer.normalization, 2)
    total = norm_bytes(shape, h, layer.normalization, layer.recompute_norm)
    total += shape.residual(h)  # the down-projections' input
    latents = [attn.kv_lora_rank]
    if attn.q_layernorm is not None:
        latents.append(attn.linear_q_down_proj.weight.shape[0])
    for rank in latents:  # norm input and statistics, up-projection input (gathered under sp)
        total += shape.residual(rank) + shape.residual(stats, 4) + shape.tensor(rank)
    total += shape.tensor(4 * pos)  # cos and sin, for the queries and the key
    qkv, out = shape.tensor(heads * (2 * qd + vd)), shape.tensor(heads * vd)
    dropout = getattr(attn.core_attention, "dropout", 0.0)
    # The core attention pads v to the keys' width (a fused kernel wants one head dim): the
    # kernel keeps q, k, the padded v and its padded output; the projection a narrow copy.
    padded = shape.tensor(heads * 4 * qd) + out
    if attn.recompute_core:  # its inputs: v a view of the whole up-projected [k_nope; v]
        total += qkv + out + shape.tensor(heads * attn.qk_head_dim)
    elif not shape.cuda and dropout > 0:
        # torch's CPU math kernel: q, k, v, the probabilities, the mask and the dropped ones
        scores = shape.micro_batch_size * heads * shape.seq_length * shape.context_length
        total += padded + scores * shape.dtype_bytes * 3
    else:
        total += padded + shape.tensor(heads, 4)  # fused: the log-sum-exp besides
    return total + shape.dropout_mask(h, layer.hidden_dropout)


def attention_layer_bytes(layer, shape) -> int:
    """``*``: norm, QKV input, core attention, output projection input, residual dropout."""
    attn = layer.self_attention
    if hasattr(attn, "linear_kv_down_proj"):  # multi-latent attention
        return mla_layer_bytes(layer, shape)
    core = attn.core_attention
    h = attn.linear_qkv.weight.shape[1]
    heads, groups, d = attn.num_heads, attn.num_groups, attn.head_dim
    total = norm_bytes(shape, h, layer.normalization, layer.recompute_norm)
    total += shape.residual(h)  # linear_qkv's input (sequence shard under sp)
    dropout = getattr(core, "dropout", 0.0)
    math_kernel = not shape.cuda and dropout > 0  # masks alone run fused kernels too
    window = getattr(core, "window_size", None)
    windowed = window is not None and window[0] < shape.context_length - 1
    # torch's math kernel computes half precision in fp32 (and keeps fp32 copies) everywhere;
    # the local backend's other kernels do so on CPUs without AMX for the dtype
    kernel_bytes = 4 if math_kernel else getattr(core, "kernel_dtype_bytes",
                                                 lambda _: shape.dtype_bytes)(shape)
    if attn.recompute_core:  # keeps its inputs (views of the QKV output) and its output
        total += shape.tensor((heads + 2 * groups) * d) + shape.tensor(heads * d)
    elif math_kernel:
        total += math_attention(shape, heads, d, dropout, kernel_bytes) + shape.tensor(heads * d)
    else:
        total += fused_attention(shape, heads, groups, d, kernel_bytes)
        # packed documents on CPU run each document's flash attention alone (keeping what
        # flash keeps); elsewhere, as a sliding window, through a mask
        documents = getattr(layer, "document_masks", False) and shape.cuda
        if documents or windowed:  # each layer builds its mask ([b, 1, s, s] with packed
            # documents, else [1, 1, s, s]); SDPA keeps it in its additive form
            total += ((shape.micro_batch_size if documents else 1) * shape.seq_length
                      * shape.context_length * kernel_bytes)
    if attn.q_layernorm is not None:  # per-head norms of q and k: their inputs and stats
        total += shape.tensor((heads + groups) * d) + shape.tensor(2 * (heads + groups), 4)
    if layer.rotary:  # the rotation keeps its cos and sin (for q and k; per sample at most)
        total += shape.tensor(4 * d)
        if attn.recompute_core or kernel_bytes == shape.dtype_bytes:
            # attention gets the rotated q and k, new tensors, besides the QKV output that v
            # views (an fp32 kernel keeps its copies instead, counted above)
            total += shape.tensor((heads + groups) * d)
    return total + shape.dropout_mask(h, layer.hidden_dropout)


def mlp_layer_bytes(layer, shape) -> int:
    """``-``: norm, fc1 input, the activation's inputs, fc2 input, residual dropout."""
    mlp = layer.mlp
    h = mlp.linear_fc1.weight.shape[1]
    f = mlp.linear_fc2.weight.shape[1]  # this rank's ffn share
    total = norm_bytes(shape, h, layer.normalization, layer.recompute_norm)
    if layer.recompute_mlp:
        total += shape.residual(h)  # the recompute's input
    else:
        total += shape.residual(h)  # fc1 input
        if mlp.swiglu:  # fc1 output (gate and up), silu(gate), fc2 input
            total += shape.tensor(4 * f)
        elif mlp.squared_relu:  # relu output, fc2 input
            total += shape.tensor(2 * f)
        else:  # gelu input, fc2 input
            total += shape.tensor(2 * f)
    return total + shape.dropout_mask(h, layer.hidden_dropout)


# ------------------------------------------------------------------ split backward: I to W
# A schedule that splits the backward keeps, from a microbatch's I to its W, what the deferred
# weight gradients need (core/contracts/weight_grads.py): each norm's normalised input and the
# gradient of its output, each linear's input and the gradient of its output. Biases are summed
# at I; the rest of the layer's activations are freed at I.


def _norm_until_weights(shape, width: int, residual: bool = True) -> int:
    return 2 * (shape.residual(width) if residual else shape.tensor(width))


def attention_weight_grad_bytes(layer, shape) -> int:
    """``*``: the input norm, linear_qkv (its input a sequence shard under sp, gathered at W),
    q/k norms, linear_proj."""
    attn = layer.self_attention
    if hasattr(attn, "linear_kv_down_proj"):  # multi-latent attention: counted as it stores
        return mla_layer_bytes(layer, shape)
    h = attn.linear_qkv.weight.shape[1]
    total = _norm_until_weights(shape, h)
    total += shape.residual(h) + shape.tensor(attn.linear_qkv.weight.shape[0])
    if attn.q_layernorm is not None:
        total += _norm_until_weights(shape, (attn.num_heads + attn.num_groups) * attn.head_dim,
                                     residual=False)
    return total + shape.tensor(attn.linear_proj.weight.shape[1]) + shape.tensor(h)


def mlp_weight_grad_bytes(layer, shape) -> int:
    """``-``: the norm, linear_fc1 (input a sequence shard under sp), linear_fc2."""
    mlp = layer.mlp
    h = mlp.linear_fc1.weight.shape[1]
    total = _norm_until_weights(shape, h)
    total += shape.residual(h) + shape.tensor(mlp.linear_fc1.weight.shape[0])
    return total + shape.tensor(mlp.linear_fc2.weight.shape[1]) + shape.tensor(h)
