"""The Mamba-2 mixer's depthwise causal conv1d and its SiLU as one autograd function.

Why by hand: the channels arrive as ``[batch, length, channels]`` (a slice of ``in_proj``'s
output), and ``torch.nn.functional.conv1d`` wants ``[batch, channels, length]``: the two
transposes around it are copies, and torch's CPU backward of a depthwise conv (plus a separate
SiLU backward on the strided result) measured about 15% of the whole layer. A width-4 depthwise
conv is four shifted multiply-adds in the layout the data already has; the backward is four
more for the input, four dot products over time for the weights, and one sum for the bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import defer_weight_grad


class _ConvSiLU(torch.autograd.Function):
    """``silu(bias + sum_k weight[:, k] * x[t - (width - 1) + k])`` over ``[b, l, ch]``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        width, length = weight.shape[-1], x.shape[1]
        taps = weight.reshape(-1, width).t().contiguous()          # [width, ch]
        padded = F.pad(x, (0, 0, width - 1, 0))                    # zeros before the start
        pre = torch.addcmul(bias, padded[:, :length], taps[0])
        for k in range(1, width):
            pre.addcmul_(padded[:, k:k + length], taps[k])
        ctx.save_for_backward(padded, taps, pre)
        ctx.weight_shape, ctx.weight = weight.shape, weight  # the parameter, for deferral
        return F.silu(pre)

    @staticmethod
    def backward(ctx, grad):
        padded, taps, pre = ctx.saved_tensors
        width, length = taps.shape[0], pre.shape[1]
        grad_pre = torch.ops.aten.silu_backward(grad.contiguous(), pre)
        # x[u] fed output t = u + (width - 1) - k through tap k.
        after = F.pad(grad_pre, (0, 0, 0, width - 1))
        grad_x = after[:, width - 1:width - 1 + length] * taps[0]
        for k in range(1, width):
            grad_x.addcmul_(after[:, width - 1 - k:width - 1 - k + length], taps[k])
        def weight_grad():
            return torch.stack([(padded[:, k:k + length] * grad_pre).sum((0, 1))
                                for k in range(width)], dim=-1).reshape(ctx.weight_shape)

        # In a split backward (zero-bubble schedules) the taps' gradient waits for W.
        grad_w = None if defer_weight_grad(ctx.weight, weight_grad) else weight_grad()
        return grad_x, grad_w, grad_pre.sum((0, 1))


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x``: ``[batch, length, channels]``; ``weight``: ``[channels, 1, width]`` (a depthwise
    ``Conv1d``'s); ``bias``: ``[channels]``. Output as ``x``, causal (token t sees t-3..t)."""
    return _ConvSiLU.apply(x, weight, bias)
