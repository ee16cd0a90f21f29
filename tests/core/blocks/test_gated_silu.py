"""``silu_and_mul``: autograd's ``silu(gate) * up`` bit for bit, forward and backward, keeping
the same tensors for backward (so the activation estimate holds)."""

import torch
import torch.nn.functional as F
from plugtron.api import silu_and_mul
from plugtron.testing import saved_activation_bytes


class _Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _autograd(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_equals_autograd_bit_for_bit_and_keeps_what_it_keeps():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    grad = torch.randn(3, 5, 8, generator=gen)
    ours, theirs = silu_and_mul(x), _autograd(x)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.autograd.grad(ours, x, grad)[0],
                       torch.autograd.grad(theirs, x, grad)[0])
    assert saved_activation_bytes(_Module(silu_and_mul), x) == \
        saved_activation_bytes(_Module(_autograd), x)
    with torch.no_grad():
        assert torch.equal(silu_and_mul(x), theirs)
