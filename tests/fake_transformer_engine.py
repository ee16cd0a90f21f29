"""A CPU stand-in for ``transformer_engine.pytorch``, for checking the ``te`` backend's module
structure and parameter names where transformer-engine cannot run (no CUDA).

It mirrors only what the backend relies on, as TE documents and implements it: ``Linear``
registers ``weight`` ``[out, in]`` and, with ``bias``, ``bias`` (without: a plain empty tensor
attribute), marks its weight tensor-parallel along dim 0 even when ``parallel_mode`` is None,
adds the bias in the GEMM unless ``return_bias``, which returns it instead; ``LayerNorm`` has
``weight`` and ``bias``, ``RMSNorm`` ``weight``; ``DotProductAttention`` takes ``bshd`` q, k, v
and returns ``[b, s, heads * d]``. The maths is plain torch, so a model built on it computes what
``local`` computes.
"""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, init_method=None,
                 parallel_mode=None, return_bias=False, **_):
        super().__init__()
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.parallel_mode = parallel_mode
        self.sequence_parallel = False  # TE's own attribute, unrelated to plugtron's SP
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, 0
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features))
        else:
            self.bias = torch.Tensor()

    def forward(self, inp):
        out = F.linear(inp, self.weight, self.bias if self.apply_bias else None)
        return (out, self.bias) if self.return_bias else out


class LayerNorm(torch.nn.LayerNorm):
    def __init__(self, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)


class DotProductAttention(torch.nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal", **_):
        super().__init__()
        assert qkv_format == "bshd" and attn_mask_type == "causal"
        self.num_heads = num_attention_heads
        self.num_groups = num_gqa_groups or num_attention_heads
        self.attention_dropout = attention_dropout  # TE keeps the probability (a float)

    def forward(self, query_layer, key_layer, value_layer):
        b, s = query_layer.shape[0], query_layer.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.num_groups != self.num_heads)
        return out.transpose(1, 2).reshape(b, s, -1)


def module() -> types.ModuleType:
    fake = types.ModuleType("fake_transformer_engine.pytorch")
    fake.Linear, fake.LayerNorm, fake.RMSNorm = Linear, LayerNorm, RMSNorm
    fake.DotProductAttention = DotProductAttention
    return fake


@contextlib.contextmanager
def installed():
    """While active, ``--layer-backend te`` builds on this stand-in (on CPU)."""
    with mock.patch("plugtron.plugins.layer_backends.te.import_transformer_engine",
                    return_value=module()):
        yield
