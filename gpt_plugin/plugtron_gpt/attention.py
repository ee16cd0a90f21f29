"""Layer type ``*``: pre-norm causal self-attention with grouped-query heads.

The fused QKV projection is laid out per query group, ``[q_1..q_n, k, v]`` for each group, so a
contiguous split of its rows over tp gives each rank whole groups.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from plugtron.core.init import normal_init, scaled_normal_init

from .rope import apply_rotary


class SelfAttentionLayer(torch.nn.Module):
    symbol = "*"

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        m = config.model
        tp = parallel.tp_size
        self.backend = backend
        self.num_heads = m.num_attention_heads // tp
        self.num_groups = (m.num_query_groups or m.num_attention_heads) // tp
        self.heads_per_group = self.num_heads // self.num_groups
        self.head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
        total_heads = m.num_attention_heads + 2 * (m.num_query_groups or m.num_attention_heads)
        prefix = f"decoder.layers.{layer_number - 1}.self_attention"
        self.input_layernorm = backend.norm(m.hidden_size)
        self.linear_qkv = backend.column_parallel_linear(
            m.hidden_size, total_heads * self.head_dim, bias=m.add_bias_linear,
            init_method=normal_init(m.init_method_std, seed, f"{prefix}.linear_qkv.weight"))
        self.core_attention = backend.core_attention(self.num_heads, self.num_groups,
                                                     self.head_dim, m.attention_dropout)
        self.linear_proj = backend.row_parallel_linear(
            m.num_attention_heads * self.head_dim, m.hidden_size, bias=m.add_bias_linear,
            init_method=scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                           f"{prefix}.linear_proj.weight"),
            input_is_parallel=True)
        self.hidden_dropout = m.hidden_dropout

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        qkv, _ = self.linear_qkv(self.input_layernorm(hidden))
        b, s = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(b, s, self.num_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :self.heads_per_group].reshape(b, s, self.num_heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        out, _ = self.linear_proj(self.core_attention(q, k, v))
        return hidden + dropout(out, self.hidden_dropout, self.training, self.backend)


def dropout(x: torch.Tensor, p: float, training: bool, backend) -> torch.Tensor:
    """Dropout on the residual stream; under sequence parallelism each tp rank holds different
    tokens, so it draws from the tp-rank-specific stream."""
    if not training or p == 0.0:
        return x
    context = backend.dropout_rng() if backend.sequence_parallel else contextlib.nullcontext()
    with context:
        return F.dropout(x, p, True)
