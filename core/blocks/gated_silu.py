"""``silu(gate) * up`` of a fused ``[gate; up]`` projection (a gated MLP's activation), whose
backward writes the two halves of the input's gradient in place.

Autograd's own backward of ``x.chunk(2)`` concatenates the two halves' gradients into a new
tensor: one more pass over the fc1 output's size (1.1 of 5.0 ms forward and backward at
[8, 256, 2 x 704] fp32, measured on the benchmark CPU). Here each half's gradient is computed
straight into its half of one buffer, with the same kernels (``silu_backward`` and a product),
so the result is bit for bit autograd's, and the same tensors are kept for backward (the input
and ``silu(gate)``: the activation estimate is unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        gate, up = x.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(x, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, act = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.mul(grad, act, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate; up]`` along its last dimension (halves of equal
    width); the backward writes both halves' gradients into one buffer."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _SiluAndMul.apply(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
