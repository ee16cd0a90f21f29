"""``linear(x, weight, bias)``: ``F.linear`` whose backward matmuls take the operand layout the
CPU runs fast in half precision.

On a CPU without native bf16/fp16 matrix instructions (AVX2 only), oneDNN runs a half-precision
matmul fast only when its left operand is row-major and its right one column-major (``a @
b.t()`` with both contiguous): 11-19 GFLOP/s against 0.4-1.2 for the other layouts, measured on
an AVX2 EPYC (benchmarks/RESULTS.md, "Half precision on an AVX2 CPU"). ``F.linear``'s forward is that
layout already; its autograd backward is not: ``grad @ weight`` has both operands row-major,
and fp16's ``grad.t() @ x`` is slow too. Here both backward matmuls make their operands that
layout first; the copies (the weight, and the gradient and input of one microbatch) cost a
fraction of one matmul. Everywhere else (fp32, CUDA, other devices, and CPUs with AVX-512
BF16/FP16 or AMX, where every layout runs fast and the copies only cost: core/blocks/cpu_features.py)
it is ``F.linear`` itself, autograd and all, so nothing changes where the layouts do not matter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.core.blocks.cpu_features import cpu_matrix_support
from plugtron.core.contracts import weight_grads as wgrad

_HALF = (torch.bfloat16, torch.float16)


def _needs_layout(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_half_on_cpu(weight) and x.dtype == weight.dtype and torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad))


def _nt_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.t()`` with ``a`` and ``b_t`` made contiguous: row-major times column-major."""
    return a.contiguous() @ b_t.contiguous().t()


def _half_on_cpu(weight: torch.Tensor) -> bool:
    """Half precision on a CPU that emulates it: the one case the layouts matter."""
    return (weight.device.type == "cpu" and weight.dtype in _HALF
            and cpu_matrix_support(weight.dtype) == "emulated")


def input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad @ weight``: the input gradient of ``F.linear(x, weight)`` (``grad`` 2-D)."""
    if _half_on_cpu(weight):
        # weight.t() made contiguous is the weight stored column-major.
        return _nt_matmul(grad, weight.t())
    return grad.matmul(weight)


def weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad.t() @ x``: the weight gradient of ``F.linear(x, weight)`` (both 2-D)."""
    if _half_on_cpu(weight):
        return _nt_matmul(grad.t(), x.t())
    return grad.t().matmul(x)


class _HalfLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # The parameter itself, for deferral: a saved tensor may come back as another object
        # (e.g. from a recompute), and a deferred gradient must reach this one.
        ctx.weight = weight
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = input_grad(flat_grad, weight).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            flat_x = x.reshape(-1, x.shape[-1])
            if not wgrad.defer_weight_grad(ctx.weight,
                                           lambda: weight_grad(flat_grad, flat_x, weight)):
                grad_weight = weight_grad(flat_grad, flat_x, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(dim=0)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with fast half-precision backward matmuls on CPU.

    In the forward of a microbatch whose backward a schedule splits into ``I`` and ``W``
    (``plugtron.core.contracts.weight_grads``), the weight gradient is deferred to ``W``."""
    if _needs_layout(x, weight) or (wgrad.split_backward_expected() and weight.requires_grad
                                    and torch.is_grad_enabled()):
        return _HalfLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
