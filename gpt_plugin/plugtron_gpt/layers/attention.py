"""Layer type ``*``: pre-norm causal self-attention with grouped-query heads.

Children as in Megatron-Core, so parameters read ``decoder.layers.{i}.input_layernorm.*`` and
``decoder.layers.{i}.self_attention.{linear_qkv,linear_proj}.*``, alone (one symbol per layer, as
the Hybrid model composes) or composed with ``-`` under the same index (a GPT layer).

The fused QKV projection is laid out per query group, ``[q_1..q_n, k, v]`` for each group, so a
contiguous split of its rows over tp gives each rank whole groups.

With ``--multi-latent-attention`` its ``self_attention`` is DeepSeek's multi-latent attention
instead (mla.py: ``linear_q_down_proj``, ``linear_kv_down_proj``, ... ).

Options (attention_options.py): ``--add-qkv-bias`` (Qwen2), ``--qk-layernorm`` (Qwen3: one norm
of ``head_dim`` channels shared by every query head, one by every key head, applied per head
before rotary, Megatron-Core's ``q_layernorm`` / ``k_layernorm``) and ``--window-size``
(Mistral's sliding window, applied by the backend's core attention).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from plugtron.api import (
    apply_rotary,
    current_forward_context,
    mark_fused_parts,
    mark_sequence_parallel,
    normal_init,
    recompute,
    recompute_module,
    record_max_logits,
    scaled_normal_init,
    yarn_attention_factor,
)
from plugtron_gpt.layers.activations import attention_layer_bytes, attention_weight_grad_bytes
from plugtron_gpt.layers.attention_logits import layer_max_logits
from plugtron_gpt.layers.attention_options import (
    SECTION,
    attention_options,
    parse_window,
    rope_scaling,
    validate_attention,
)
from plugtron_gpt.layers.mla import MultiLatentAttention
from plugtron_gpt.layers.transformer_options import SECTION as TRANSFORMER
from plugtron_gpt.layers.transformer_options import validate_transformer


class SelfAttention(torch.nn.Module):
    """QKV projection, core attention and output projection over this rank's heads (no norm,
    no residual): ``self_attention`` of a decoder layer."""

    def __init__(self, config, backend, parallel, prefix: str, seed: int):
        super().__init__()
        m = config.model
        tp = parallel.tp_size
        self.cache_key = prefix  # this layer's entry in a generation's KV cache
        self.num_heads = m.num_attention_heads // tp
        self.num_groups = (m.num_query_groups or m.num_attention_heads) // tp
        self.heads_per_group = self.num_heads // self.num_groups
        self.head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
        total_heads = m.num_attention_heads + 2 * (m.num_query_groups or m.num_attention_heads)
        options = attention_options(config)
        # Init keys are the parameters' final names: the same weights under every layout.
        self.linear_qkv = backend.column_parallel_linear(
            m.hidden_size, total_heads * self.head_dim,
            bias=m.add_bias_linear or options.add_qkv_bias,
            init_method=normal_init(m.init_method_std, seed, f"{prefix}.linear_qkv.weight"))
        # Q, K and V per query group: a matrix optimizer (Muon) may take each as its own matrix
        mark_fused_parts(self.linear_qkv.weight,
                         (self.heads_per_group * self.head_dim, self.head_dim, self.head_dim),
                         groups=m.num_query_groups or m.num_attention_heads, kind="qkv")
        self.q_layernorm = self.k_layernorm = None
        if options.qk_layernorm:
            self.q_layernorm = backend.norm(self.head_dim)
            self.k_layernorm = backend.norm(self.head_dim)
            # Replicated over tp but each rank normalises other heads: their gradients are
            # partial sums, added over tp in finalize like sequence-parallel norms (Megatron).
            if parallel.tp_size > 1:
                mark_sequence_parallel(self.q_layernorm)
                mark_sequence_parallel(self.k_layernorm)
        window = parse_window(options.window_size)
        self.window = window  # what QK-clip's logits cover too
        extra = {"window_size": window} if window is not None else {}
        self.core_attention = backend.core_attention(self.num_heads, self.num_groups,
                                                     self.head_dim, m.attention_dropout, **extra)
        self.linear_proj = backend.row_parallel_linear(
            m.num_attention_heads * self.head_dim, m.hidden_size, bias=m.add_bias_linear,
            init_method=scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                           f"{prefix}.linear_proj.weight"),
            input_is_parallel=True)
        self.recompute_core = recompute_module(config, "core_attn")
        self.qk_clip = config.training.qk_clip
        self.parallel = parallel
        #: cos and sin times this: YaRN's attention factor (1 otherwise)
        self.rotary_mscale = yarn_attention_factor(rope_scaling(config))

    def forward(self, x: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        qkv, _ = self.linear_qkv(x)
        b, s = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(b, s, self.num_groups, self.heads_per_group + 2, self.head_dim)
        # One split, not three slices: backward then concatenates the three gradients once,
        # where each slice's backward would fill a zeroed qkv-sized tensor and add them up
        # (several % of a step on CPU). Same values either way.
        q, k, v = qkv.split([self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q = apply_rotary(q, rotary, self.rotary_mscale)
            k = apply_rotary(k, rotary, self.rotary_mscale)
        inference = current_forward_context().inference
        if self.qk_clip and self.training and inference is None:
            record_max_logits(self, self.linear_qkv.weight,
                              layer_max_logits(q, k, self.parallel, self.window))
        if inference is not None:  # generation: attend over the cached keys too
            k, v = inference.update(self.cache_key, k, v)
        # Selective recompute (Megatron's default, core_attn): the [s, s] scores and softmax
        # are the large activations, and cheap to compute again.
        context = (recompute(self.core_attention, q, k, v) if self.recompute_core
                   else self.core_attention(q, k, v))
        out, _ = self.linear_proj(context)
        return out


class SelfAttentionLayer(torch.nn.Module):
    """``hidden + dropout(self_attention(input_layernorm(hidden)))``."""

    symbol = "*"
    #: The parts --recompute-granularity selective may recompute (--recompute-modules).
    recompute_modules = ("core_attn", "layernorm")
    supports_context_parallel = True  # core_attention reaches the keys on other cp ranks
    supports_kv_cache = True  # generation keeps its k/v (SelfAttention.forward)

    @staticmethod
    def plugtron_config_sections():
        return [TRANSFORMER, SECTION]

    @staticmethod
    def plugtron_validate(config):
        validate_transformer(config)
        validate_attention(config)

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        m = config.model
        self.backend = backend
        self.input_layernorm = backend.norm(m.hidden_size)
        # --multi-latent-attention swaps the attention itself; norm and residual stay.
        kind = (MultiLatentAttention if attention_options(config).multi_latent_attention
                else SelfAttention)
        self.self_attention = kind(
            config, backend, parallel, f"decoder.layers.{layer_number - 1}.self_attention", seed)
        self.hidden_dropout = m.hidden_dropout
        self.recompute_norm = recompute_module(config, "layernorm")
        self.normalization = m.normalization
        self.rotary = m.position_embedding_type == "rope"
        samples = getattr(config, "samples", None)  # the datasets' section, when installed
        self.document_masks = bool(samples is not None and samples.reset_attention_mask)

    def activation_bytes(self, shape) -> int:
        """Bytes kept for backward per microbatch (``plugtron estimate``)."""
        return attention_layer_bytes(self, shape)

    def weight_grad_bytes(self, shape) -> int:
        """Bytes a split backward keeps from this layer's I to its W (``plugtron estimate``)."""
        return attention_weight_grad_bytes(self, shape)

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        normed = (recompute(self.input_layernorm, hidden) if self.recompute_norm
                  else self.input_layernorm(hidden))
        out = self.self_attention(normed, rotary)
        return hidden + dropout(out, self.hidden_dropout, self.training, self.backend)


def dropout(x: torch.Tensor, p: float, training: bool, backend) -> torch.Tensor:
    """Dropout on the residual stream; under sequence parallelism each tp rank holds different
    tokens, so it draws from the tp-rank-specific stream."""
    if not training or p == 0.0:
        return x
    context = backend.dropout_rng() if backend.sequence_parallel else contextlib.nullcontext()
    with context:
        return F.dropout(x, p, True)
