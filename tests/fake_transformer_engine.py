"""A CPU stand-in for ``transformer_engine.pytorch``, for checking the ``te`` backend's module
structure and parameter names where transformer-engine cannot run (no CUDA).

It mirrors only what the backend relies on, as TE documents and implements it: ``Linear``
registers ``weight`` ``[out, in]`` and, with ``bias``, ``bias`` (without: a plain empty tensor
attribute), marks its weight tensor-parallel along dim 0 even when ``parallel_mode`` is None,
adds the bias in the GEMM unless ``return_bias``, which returns it instead; ``LayerNorm`` has
``weight`` and ``bias``, ``RMSNorm`` ``weight``; ``DotProductAttention`` takes ``bshd`` q, k, v
and returns ``[b, s, heads * d]``, or THD (``qkv_format="thd"``, ``[tokens, heads, d]``, mask
type ``padding_causal``, int32 ``cu_seqlens`` from 0 to the token count, ``max_seqlen`` the
longest) and returns ``[tokens, heads * d]``, each sequence causal on its own. The maths is plain torch, so a model built on it computes what
``local`` computes.

Delayed weight gradients, as TE (2.3 on) has them: ``Linear(..., delay_wgrad_compute=True)``
builds ``wgrad_store`` switched on (else off, with no queue) and marks its parameters
``skip_backward_post_hook``. A forward captures the store only while it is on (TE 2.16 on;
``module(delay_wgrad="always")``: always, as TE 2.4 to 2.15); that call's backward, if the store
is on then, queues ``[input, grad_output]`` and the weight-gradient GEMM (``put``) and returns no
weight gradient, nor a gradient for a bias added in the GEMM, else it computes both at once.
``pop()`` (only while on) runs the oldest entry: ``((wgrad, bgrad), tensors)``, ``bgrad`` None
without a GEMM bias; an empty queue raises. ``module(delay_wgrad=False)`` is a TE before 2.3:
its ``Linear`` has neither the argument nor the store.
"""

from __future__ import annotations

import contextlib
import queue
import types
from unittest import mock

import torch
import torch.nn.functional as F


class WeightGradStore:
    """TE's per-module FIFO of delayed weight-gradient GEMMs."""

    def __init__(self, delay_wgrad_compute=False, ub_bulk_wgrad=False):
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = bool(delay_wgrad_compute)

    def delay_wgrad_compute(self):
        return self.enabled

    def enable_delay_wgrad_compute(self):
        self.enabled = True

    def disable_delay_wgrad_compute(self):
        self.enabled = False

    def put(self, tensor_list, func):
        assert self.enabled, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        assert self.enabled, "delay_wgrad_compute is not enabled"
        if self.context.qsize() == 0:
            raise RuntimeError("Pop empty queue.")
        tensor_list, func = self.context.get()
        return func(*tensor_list), tensor_list


class _Linear(torch.autograd.Function):
    """TE's linear: the weight-gradient GEMM (with the bias gradient fused) runs in backward,
    or is queued in the store captured at forward while that store is on."""

    @staticmethod
    def forward(ctx, inp, weight, bias, wgrad_store):
        ctx.save_for_backward(inp, weight)
        ctx.has_bias, ctx.wgrad_store = bias is not None, wgrad_store
        return F.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        x = inp.reshape(-1, inp.shape[-1])
        dgrad = (dy @ weight).view(inp.shape) if ctx.needs_input_grad[0] else None
        wgrad = bgrad = None
        if ctx.needs_input_grad[1]:
            has_bias = ctx.has_bias

            def wgrad_gemm(x, dy):
                return dy.t() @ x, (dy.sum(dim=0) if has_bias else None)

            store = ctx.wgrad_store
            if store is not None and store.delay_wgrad_compute():
                store.put([x, dy], wgrad_gemm)
            else:
                wgrad, bgrad = wgrad_gemm(x, dy)
        return dgrad, wgrad, bgrad if ctx.has_bias else None, None


class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, init_method=None,
                 parallel_mode=None, return_bias=False, delay_wgrad_compute=False, **_):
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
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        if delay_wgrad_compute:
            for param in self.parameters():
                param.skip_backward_post_hook = True

    def forward(self, inp):
        store = self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None
        out = _Linear.apply(inp, self.weight, self.bias if self.apply_bias else None, store)
        return (out, self.bias) if self.return_bias else out


class LinearCapturingTheStoreAlways(Linear):
    """``Linear`` of TE 2.4 to 2.15: every forward captures the store, whether on or not; only
    its state when the backward runs decides."""

    def forward(self, inp):
        out = _Linear.apply(inp, self.weight, self.bias if self.apply_bias else None,
                            self.wgrad_store)
        return (out, self.bias) if self.return_bias else out


class LinearBeforeDelayedWgrad(Linear):
    """``Linear`` of a TE before 2.3: no ``delay_wgrad_compute``, no ``wgrad_store``."""

    def __init__(self, in_features, out_features, bias=True, init_method=None,
                 parallel_mode=None, return_bias=False, **_):
        super().__init__(in_features, out_features, bias=bias, parallel_mode=parallel_mode,
                         return_bias=return_bias)
        del self.wgrad_store

    def forward(self, inp):
        out = _Linear.apply(inp, self.weight, self.bias if self.apply_bias else None, None)
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

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None):
        if qkv_format == "thd":  # [tokens, heads, d], one sequence per cu_seqlens interval
            assert attn_mask_type == "padding_causal" and attention_mask is None
            assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_kv)
            bounds = cu_seqlens_q.tolist()
            assert bounds[0] == 0 and bounds[-1] == query_layer.shape[0]
            assert max_seqlen_q == max_seqlen_kv == max(b - a for a, b in zip(bounds, bounds[1:]))
            parts = [self._bshd(query_layer[None, a:e], key_layer[None, a:e],
                                value_layer[None, a:e])[0] for a, e in zip(bounds, bounds[1:])]
            return torch.cat(parts)
        assert qkv_format in (None, "bshd") and attention_mask is None
        return self._bshd(query_layer, key_layer, value_layer)

    def _bshd(self, query_layer, key_layer, value_layer):
        b, s = query_layer.shape[0], query_layer.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.num_groups != self.num_heads)
        return out.transpose(1, 2).reshape(b, s, -1)


#: ``delay_wgrad`` of :func:`module` -> its ``Linear``
LINEARS = {True: Linear, "always": LinearCapturingTheStoreAlways,
           False: LinearBeforeDelayedWgrad}


def module(delay_wgrad: bool | str = True) -> types.ModuleType:
    """The stand-in ``transformer_engine.pytorch``; ``delay_wgrad``: ``True`` the newest TE's
    delayed wgrad, ``"always"`` TE 2.4 to 2.15's, ``False`` a TE before 2.3 (none)."""
    fake = types.ModuleType("fake_transformer_engine.pytorch")
    fake.Linear = LINEARS[delay_wgrad]
    fake.LayerNorm, fake.RMSNorm = LayerNorm, RMSNorm
    fake.DotProductAttention = DotProductAttention
    return fake


@contextlib.contextmanager
def installed(delay_wgrad: bool | str = True):
    """While active, ``--layer-backend te`` builds on this stand-in (on CPU)."""
    with mock.patch("plugtron.plugins.layer_backends.te.import_transformer_engine",
                    return_value=module(delay_wgrad)):
        yield
