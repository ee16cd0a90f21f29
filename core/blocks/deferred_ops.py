"""Ops whose weight gradient a split backward can defer to ``W`` (see
``core/contracts/weight_grads.py``), beside ``linear``: the elementwise affine of a norm and the
batched and grouped matmuls of grouped experts.

Each builds its deferrable autograd function only in the forward of a microbatch whose backward
a schedule splits (``split_backward_expected``); every other forward runs the usual torch op, so
combined backwards run exactly the kernels they ran before.
"""

from __future__ import annotations

import torch
from plugtron.core.contracts import weight_grads as wgrad


def _splitting(weight: torch.Tensor) -> bool:
    return (wgrad.split_backward_expected() and weight.requires_grad
            and torch.is_grad_enabled())


def _sum_to_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(dim=0)


class _Affine(torch.autograd.Function):
    """``x * weight (+ bias)`` over the last dimension, the weight's gradient deferred."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.has_bias = weight, bias is not None
        out = x * weight
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad * weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            def compute():
                return _sum_to_last_dim(grad * x)
            if not wgrad.defer_weight_grad(ctx.weight, compute):
                grad_weight = compute()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = _sum_to_last_dim(grad)
        return grad_x, grad_weight, grad_bias


def affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``x * weight + bias`` (a norm's scale and shift, broadcast over the last dimension); in
    a split backward the weight's gradient waits for ``W`` (the bias's, a sum, comes at ``I``).
    """
    if _splitting(weight):
        return _Affine.apply(x, weight, bias)
    out = x * weight
    return out + bias if bias is not None else out


class _BatchedMatmul(torch.autograd.Function):
    """``x @ weight.transpose(1, 2)`` for ``x`` ``[E, n, in]``, ``weight`` ``[E, out, in]``."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight
        return torch.bmm(x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            def compute():
                return torch.bmm(grad.transpose(1, 2), x)
            if not wgrad.defer_weight_grad(ctx.weight, compute):
                grad_weight = compute()
        return grad_x, grad_weight


class _GroupedMatmul(torch.autograd.Function):
    """``torch._grouped_mm(x, weight.transpose(1, 2), offs)``: ``x`` ``[tokens, in]`` in groups
    ending at ``offs``, ``weight`` ``[G, out, in]``; both gradients by grouped mms, the
    weight's (``grad`` transposed times ``x``, grouped along the tokens) deferred."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        ctx.save_for_backward(x, weight, offs)
        ctx.weight = weight
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()  # the grouped mm refuses a broadcast (stride 0) gradient
        grad_x = (torch._grouped_mm(grad, weight, offs=offs) if ctx.needs_input_grad[0]
                  else None)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            def compute():
                return torch._grouped_mm(grad.t(), x, offs=offs)
            if not wgrad.defer_weight_grad(ctx.weight, compute):
                grad_weight = compute()
        return grad_x, grad_weight, None


class _LayerNorm(torch.autograd.Function):
    """torch's fused layer norm whose scale's gradient waits for ``W`` (the input's and the
    shift's come with ``I``, from the fused backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        out, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.weight = weight
        return out

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x, _, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad, x, [x.shape[-1]], mean, rstd, weight, bias,
            [needs[0], False, bias is not None and needs[2]])
        grad_weight = None
        if needs[1]:
            def compute():  # torch's fused backward, asked for the scale's gradient alone
                return torch.ops.aten.native_layer_norm_backward(
                    grad, x, [x.shape[-1]], mean, rstd, weight, bias, [False, True, False])[1]
            if not wgrad.defer_weight_grad(ctx.weight, compute):
                grad_weight = compute()
        return grad_x, grad_weight, grad_bias, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """``F.layer_norm`` over the last dimension; in a split backward the scale's gradient
    waits for ``W`` while the forward and the input's gradient stay torch's fused kernels."""
    if _splitting(weight):
        return _LayerNorm.apply(x, weight, bias, eps)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)``: one linear per group of
    rows of ``x`` (an expert's tokens, the groups ending at ``offs``), where torch's grouped mm
    runs; in a split backward the weight's gradient waits for ``W`` (as :func:`batched_linear`,
    without padding the groups)."""
    if _splitting(weight):
        return _GroupedMatmul.apply(x, weight, offs)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)


def batched_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(x, weight.transpose(1, 2))``: one linear per group (an expert's rows, padded
    to a common count). ``weight`` may be built from parameters (``torch.stack`` of the
    experts' weights): in a split backward its gradient, computed at ``W``, flows from there to
    them."""
    if _splitting(weight):
        return _BatchedMatmul.apply(x, weight)
    return torch.bmm(x, weight.transpose(1, 2))
