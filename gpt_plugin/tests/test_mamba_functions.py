"""The Mamba-2 mixer's hand-written autograd functions (conv + SiLU, the chunked scan, gated
norm): gradcheck in float64 (their backwards are written by hand, so autograd's numerical check
is the reference), and each equals the plain torch ops it replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron_gpt.hybrid.causal_conv import causal_conv_silu
from plugtron_gpt.hybrid.gated_norm import gated_rms_norm
from plugtron_gpt.hybrid.ssd import sequential_scan
from plugtron_gpt.hybrid.ssd_chunked import chunked_scan


def test_conv_silu_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, dtype=torch.float64, generator=g)
    w = torch.randn(5, 1, 4, dtype=torch.float64, generator=g)
    b = torch.randn(5, dtype=torch.float64, generator=g)
    args = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(causal_conv_silu, args)


def test_conv_silu_equals_torch_conv1d():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 7, generator=g)
    conv = torch.nn.Conv1d(7, 7, 4, groups=7, padding=3)
    want = F.silu(conv(x.transpose(1, 2))[..., :9].transpose(1, 2))
    got = causal_conv_silu(x, conv.weight, conv.bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _scan_inputs(length, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, 4, 3, dtype=torch.float64, generator=g)
    dt = F.softplus(torch.randn(2, length, 4, dtype=torch.float64, generator=g))
    A = -torch.rand(4, dtype=torch.float64, generator=g) * 2 - 0.1
    B = torch.randn(2, length, 2, 3, dtype=torch.float64, generator=g)
    C = torch.randn(2, length, 2, 3, dtype=torch.float64, generator=g)
    D = torch.randn(4, dtype=torch.float64, generator=g)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


def test_chunked_scan_gradcheck():
    """Three chunks (the last one padded), two groups of two heads, the D skip: the closed-form
    gradients through both decay matrices (in-chunk and between chunks) and the one shared
    output matmul against finite differences."""
    args = _scan_inputs(7, seed=2)
    assert torch.autograd.gradcheck(lambda *a: chunked_scan(*a, 3), args)


def test_chunked_scan_equals_recurrence_plus_skip():
    x, dt, A, B, C, D = _scan_inputs(9, seed=4)
    want = sequential_scan(x, dt, A, B, C) + x * D[:, None]
    torch.testing.assert_close(chunked_scan(x, dt, A, B, C, D, 4), want, rtol=1e-12, atol=1e-12)


def test_gated_rms_norm_gradcheck_and_value():
    g = torch.Generator().manual_seed(3)
    y = torch.randn(2, 3, 8, dtype=torch.float64, generator=g)
    z = torch.randn(2, 3, 8, dtype=torch.float64, generator=g)
    w = torch.randn(8, dtype=torch.float64, generator=g)
    args = [t.requires_grad_() for t in (y, z, w)]
    assert torch.autograd.gradcheck(lambda *a: gated_rms_norm(*a, 4, 1e-5), args)
    u = (y * F.silu(z)).unflatten(-1, (2, 4))
    want = w * (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2)
    torch.testing.assert_close(gated_rms_norm(y, z, w, 4, 1e-5), want)
