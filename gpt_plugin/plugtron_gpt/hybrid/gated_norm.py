"""The Mamba-2 mixer's gated RMSNorm, ``weight * rmsnorm_groups(y * silu(z))``, as one autograd
function.

Why by hand: autograd differentiates its six elementwise ops one by one (each a pass over the
``[tokens, inner]`` activations, several keeping their own copy for backward); the closed-form
backward of an RMSNorm needs only the normalised output and the per-group reciprocal RMS:
``du = rstd * (dn - n * mean(dn * n))`` over each group, then the product rule through the gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import defer_weight_grad


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 activations are normalised in fp32; fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, z, weight, group_size, eps):
        gate = F.silu(_wide(z))
        grouped = (_wide(y) * gate).unflatten(-1, (-1, group_size))
        rstd = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
        normed = (grouped * rstd).flatten(-2).to(y.dtype)
        ctx.save_for_backward(y, z, gate, normed, rstd, weight)
        ctx.group_size, ctx.weight = group_size, weight  # the parameter, for deferral
        return weight * normed

    @staticmethod
    def backward(ctx, grad):
        y, z, gate, normed, rstd, weight = ctx.saved_tensors
        def weight_grad():
            return (grad * normed).sum(tuple(range(grad.dim() - 1)))

        # In a split backward (zero-bubble schedules) the scale's gradient waits for W.
        grad_weight = None if defer_weight_grad(ctx.weight, weight_grad) else weight_grad()
        d_normed = _wide(grad * weight).unflatten(-1, (-1, ctx.group_size))
        n = _wide(normed).unflatten(-1, (-1, ctx.group_size))
        d_u = (d_normed - n * (d_normed * n).mean(-1, keepdim=True)).mul_(rstd).flatten(-2)
        grad_y = (d_u * gate).to(y.dtype)
        grad_z = torch.ops.aten.silu_backward(d_u * _wide(y), _wide(z)).to(z.dtype)
        return grad_y, grad_z, grad_weight, None, None


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """``y``, ``z``: ``[..., channels]``; normalised over each group of ``group_size``
    channels; ``weight``: ``[channels]``."""
    return _GatedRMSNorm.apply(y, z, weight, group_size, eps)
