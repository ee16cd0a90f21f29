"""core/parallel/attention_blocks.py on one process: with rows cut into many tiles (TILE_ELEMENTS made
tiny; in real runs only long sequences tile), one block over the whole sequence equals
torch's causal attention, forward and backward (fp32, 1e-5), with and without GQA."""

import math

import pytest
import torch
import torch.nn.functional as F
from plugtron.core.parallel import attention_blocks

TOL = 1e-5


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_many_row_tiles_equal_torch_attention(monkeypatch, groups):
    b, heads, s, d = 2, 4, 24, 8
    # 5 rows of 24 keys x 8 lanes per tile: 5 tiles, the last one short.
    monkeypatch.setattr(attention_blocks, "TILE_ELEMENTS", b * heads * s * 5)
    assert len(attention_blocks._row_tiles(torch.empty(b, heads, s, d), s)) == 5
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=gen, requires_grad=True)
    k = torch.randn(b, groups, s, d, generator=gen, requires_grad=True)
    v = torch.randn(b, groups, s, d, generator=gen, requires_grad=True)
    grad_out = torch.randn(b, heads, s, d, generator=gen)
    pos = torch.arange(s)
    scale = 1 / math.sqrt(d)

    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != heads)
    want_dq, want_dk, want_dv = torch.autograd.grad(want, (q, k, v), grad_out)

    with torch.no_grad():
        out, lse = attention_blocks.block_forward(q, k, v, pos, pos, scale, causal=True)
        dq, dk, dv = attention_blocks.block_backward(q, k, v, out, lse, grad_out, pos, pos,
                                                     scale, causal=True)
    for got, ref in ((out, want), (dq, want_dq), (dk, want_dk), (dv, want_dv)):
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < TOL
