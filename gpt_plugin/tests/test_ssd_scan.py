"""The chunked SSD scan of the Mamba-2 mixer equals the token-by-token recurrence (fp32,
1e-5 relative), for lengths that are and are not multiples of the chunk, and so do its
gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plugtron_gpt.hybrid.ssd import sequential_scan, ssd_scan

RTOL = 1e-5


def inputs(length, batch=2, heads=4, head_dim=3, groups=2, state=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, head_dim, generator=g)
    dt = F.softplus(torch.randn(batch, length, heads, generator=g))
    A = -torch.rand(heads, generator=g) * 4 - 0.1
    B = torch.randn(batch, length, groups, state, generator=g)
    C = torch.randn(batch, length, groups, state, generator=g)
    return [t.requires_grad_() for t in (x, dt, A, B, C)]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (16, 4), (33, 8), (5, 16), (64, 64),
                                          (50, 7)])
def test_scan_equals_sequential_recurrence(length, chunk):
    args = inputs(length)
    got, want = ssd_scan(*args, chunk_size=chunk), sequential_scan(*args)
    assert rel(got, want) < RTOL
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(length))
    grads_got = torch.autograd.grad((got * weights).sum(), args)
    grads_want = torch.autograd.grad((want * weights).sum(), args)
    for name, a, b in zip("x dt A B C".split(), grads_got, grads_want):
        assert rel(a, b) < RTOL, name


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("length,chunk", [(64, 64), (40, 128), (128, 128)])
def test_long_chunk_gradients_against_float64(length, chunk, seed):
    """Long chunks over several seeds against the recurrence in float64: A's gradient sums
    row-minus-column differences over the whole chunk, where fp32 cancellation once left it
    8.8e-5 off."""
    args = inputs(length, seed=seed)
    exact = [t.detach().double().requires_grad_() for t in args]
    weights = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(seed))
    grads_got = torch.autograd.grad((ssd_scan(*args, chunk_size=chunk) * weights).sum(), args)
    grads_want = torch.autograd.grad((sequential_scan(*exact) * weights.double()).sum(), exact)
    for name, a, b in zip("x dt A B C".split(), grads_got, grads_want):
        assert rel(a.double(), b) < RTOL, name


def test_chunk_size_does_not_change_the_result():
    args = inputs(40, seed=3)
    outs = [ssd_scan(*args, chunk_size=c) for c in (1, 3, 8, 40, 128)]
    for out in outs[1:]:
        assert rel(out, outs[0]) < RTOL
