"""The Mamba-2 mixer's hand-written autograd functions (conv + SiLU, intra-chunk scan, gated
norm): gradcheck in float64 (their backwards are written by hand, so autograd's numerical check
is the reference), and each equals the plain torch ops it replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron_gpt.causal_conv import causal_conv_silu
from plugtron_gpt.gated_norm import gated_rms_norm
from plugtron_gpt.ssd_intra import intra_chunk


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


def test_intra_chunk_gradcheck():
    """Two chunks, two groups of two heads: the closed-form gradient through the decay matrix
    (row sums minus column sums) against finite differences."""
    g = torch.Generator().manual_seed(2)
    C = torch.randn(1, 2, 2, 5, 3, dtype=torch.float64, generator=g)
    B = torch.randn(1, 2, 2, 5, 3, dtype=torch.float64, generator=g)
    X = torch.randn(1, 2, 2, 2, 5, 4, dtype=torch.float64, generator=g)
    log_decay = -torch.rand(1, 2, 2, 2, 5, dtype=torch.float64, generator=g)
    args = [t.requires_grad_() for t in (C, B, X, log_decay)]
    assert torch.autograd.gradcheck(intra_chunk, args)


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
