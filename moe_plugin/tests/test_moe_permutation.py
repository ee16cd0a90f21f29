"""The dispatcher's permutation helpers against their plain definitions: the pairs of a routing
map expert by expert, and the combine's weighted sum with its gradients."""

from __future__ import annotations

import torch
from plugtron_moe.dispatcher import TokenDispatcher
from plugtron_moe.weighted_combine import weighted_row_sum


def _routing_map(tokens=37, experts=6, topk=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, picks, True)


def test_rows_by_expert_lists_pairs_expert_major_tokens_in_order():
    routing_map = _routing_map()
    experts = [4, 1, 5]  # any order the caller asks for
    rows, cols, counts = TokenDispatcher.rows_by_expert(None, routing_map, experts)
    expected = [(int(t), e) for e in experts for t in routing_map[:, e].nonzero().flatten()]
    assert list(zip(rows.tolist(), cols.tolist())) == expected
    assert counts == [int(routing_map[:, e].sum()) for e in experts]


def test_rows_by_expert_with_an_expert_nobody_chose():
    routing_map = _routing_map()
    routing_map[:, 2] = False
    rows, cols, counts = TokenDispatcher.rows_by_expert(None, routing_map, range(6))
    assert counts[2] == 0 and 2 not in cols.tolist() and sum(counts) == rows.numel()


def test_weighted_row_sum_matches_autograd_of_its_definition_bitwise():
    gen = torch.Generator().manual_seed(1)
    rows = torch.tensor([0, 3, 3, 1, 0, 2, 4, 1])
    output = torch.randn(8, 5, generator=gen, requires_grad=True)
    weights = torch.rand(8, generator=gen, requires_grad=True)
    grad = torch.randn(6, 5, generator=gen)

    ours = weighted_row_sum(output, weights, rows, 6)
    ours.backward(grad)
    got = (ours.detach(), output.grad.clone(), weights.grad.clone())
    output.grad = weights.grad = None

    plain = output.new_zeros(6, 5).index_add(0, rows, output * weights.unsqueeze(-1))
    plain.backward(grad)
    assert torch.equal(got[0], plain)
    assert torch.equal(got[1], output.grad)
    assert torch.allclose(got[2], weights.grad, rtol=0, atol=1e-6)  # a row sum, reordered
