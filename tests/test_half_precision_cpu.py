"""CPU half precision: the linear whose backward matmuls take the fast operand layout
(core/linear.py) and the local backend's attention computed in fp32. Both must give what the
plain ops give (to the precision's rounding), and the layouts must be the fast ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plugtron.api import linear
from torch.utils._python_dispatch import TorchDispatchMode

HALF = [torch.bfloat16, torch.float16]


class _MatmulLayouts(TorchDispatchMode):
    """Records, for every aten.mm/addmm, whether the left operand is row-major and the right
    one column-major (the layout oneDNN runs fast in half precision without AVX-512)."""

    def __init__(self):
        super().__init__()
        self.layouts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2], args[-1]
            self.layouts.append((a.stride(1) == 1, b.stride(0) == 1))
        return func(*args, **(kwargs or {}))


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 16, generator=gen)
    w, b = torch.randn(12, 16, generator=gen) / 4, torch.randn(12, generator=gen)
    grad = torch.randn(3, 7, 12, generator=gen)
    leaves = [t.to(dtype).requires_grad_() for t in (x, w, b)]
    return leaves, grad.to(dtype)


def _relative(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", HALF)
def test_half_linear_matches_f_linear(dtype):
    """Forward bit-identical (the same F.linear); gradients within the dtype's rounding of the
    plain autograd's, both against an fp32 computation of the same rounded inputs."""
    ours, grad = _inputs(dtype)
    plain, _ = _inputs(dtype)
    exact = [t.detach().float().requires_grad_() for t in ours]
    out = linear(*ours)
    ref = F.linear(*plain)
    assert type(out.grad_fn).__name__ == "_HalfLinearBackward"
    assert torch.equal(out, ref)
    out.backward(grad)
    ref.backward(grad)
    F.linear(*exact).backward(grad.float())
    eps = torch.finfo(dtype).eps
    for mine, theirs, truth in zip(ours, plain, exact):
        assert mine.grad.dtype == dtype
        assert _relative(mine.grad, truth.grad) <= max(2 * eps, 2 * _relative(theirs.grad,
                                                                              truth.grad))


@pytest.mark.parametrize("dtype", HALF)
def test_half_linear_backward_uses_row_by_column_major(dtype):
    (x, w, b), grad = _inputs(dtype)
    out = linear(x, w, b)
    with _MatmulLayouts() as seen:
        out.backward(grad)
    assert seen.layouts == [(True, True), (True, True)], seen.layouts


def test_plain_f_linear_backward_is_the_slow_layout():
    """The reason for the above: autograd's own grad_input matmul is row-major x row-major."""
    (x, w, b), grad = _inputs(torch.bfloat16)
    out = F.linear(x, w, b)
    with _MatmulLayouts() as seen:
        out.backward(grad)
    assert (True, False) in seen.layouts, seen.layouts


def test_fp32_and_no_grad_stay_f_linear():
    (x, w, b), _ = _inputs(torch.float32)
    assert type(linear(x, w, b).grad_fn).__name__ != "_HalfLinearBackward"
    (x, w, b), _ = _inputs(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("dtype", HALF)
def test_local_attention_in_half_precision_runs_in_fp32(dtype):
    """The local backend's training attention on CPU: the fp32 SDPA of the same inputs, cast
    back (bit-identical), gradients those of the fp32 computation cast to the dtype."""
    from plugtron.plugins.layer_backends.local import _training_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    out = _training_attention(q, k, v, is_causal=True)
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True)
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype))
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(grad)
    ref.backward(grad.float())
    for mine, truth in zip((q, k, v), exact):
        assert torch.equal(mine.grad, truth.grad.to(dtype))
