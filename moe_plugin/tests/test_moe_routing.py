"""The router's arithmetic against values derived by hand from Megatron-Core's definitions
(moe_utils.py), and against megatron-core's own functions when it is installed."""

from __future__ import annotations

import math

import pytest
import torch
from plugtron_moe import routing

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0],
                       [0.0, 3.0, 1.0, 2.0],
                       [1.0, 1.5, -0.5, 0.2]])


def test_post_softmax_top2_renormalises_over_the_chosen():
    probs, routing_map = routing.topk_routing(LOGITS, topk=2)
    # token 0 picks experts 0 (2.0) and 1 (1.0): softmax([2, 1]) = [e/(e+1), 1/(e+1)]
    e = math.e
    assert torch.allclose(probs[0], torch.tensor([e / (e + 1), 1 / (e + 1), 0.0, 0.0]))
    assert routing_map.sum(1).tolist() == [2, 2, 2]
    assert torch.allclose(probs.sum(1), torch.ones(3))


def test_pre_softmax_is_not_renormalised():
    probs, _ = routing.topk_routing(LOGITS, topk=2, pre_softmax=True)
    full = torch.softmax(LOGITS, dim=-1)
    assert torch.allclose(probs[1, [1, 3]], full[1, [1, 3]])
    assert probs[1, 0] == 0 and probs[1].sum() < 1


def test_sigmoid_with_expert_bias_changes_choice_not_weights():
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])  # expert 2 always chosen
    probs, routing_map = routing.topk_routing(LOGITS, topk=2, score_function="sigmoid",
                                              expert_bias=bias)
    assert routing_map[:, 2].all()
    s = torch.sigmoid(LOGITS)
    # token 0: experts 2 (biased) and 0 (best unbiased); weights are unbiased and normalised
    want = s[0, [0, 2]] / s[0, [0, 2]].sum()
    assert torch.allclose(probs[0, [0, 2]], want)


def test_scaling_factor_multiplies_weights():
    plain, _ = routing.topk_routing(LOGITS, topk=2)
    scaled, _ = routing.topk_routing(LOGITS, topk=2, scaling_factor=2.5)
    assert torch.allclose(scaled, plain * 2.5)


def test_group_limited_topk_masks_other_groups():
    # 4 experts in 2 groups [0,1] [2,3]; one group per token, top-2 inside it.
    _, routing_map = routing.topk_routing(LOGITS, topk=2, num_groups=2, group_topk=1)
    # token 0: group sums of top-2: [3.0, -0.5] -> group 0; token 1: [3.0, 3.0] tie -> any
    # single group; token 2: [2.5, -0.3] -> group 0
    assert routing_map[0].tolist() == [True, True, False, False]
    assert routing_map[2].tolist() == [True, True, False, False]
    assert routing_map[1].sum() == 2 and (routing_map[1, :2].all() or routing_map[1, 2:].all())


def test_switch_load_balancing_loss_definition():
    probs = torch.softmax(LOGITS, dim=-1)
    counts = torch.tensor([2.0, 3.0, 0.0, 1.0])
    got = routing.switch_load_balancing_loss(probs, counts, 3, topk=2, num_experts=4, coeff=0.1)
    want = 0.1 * 4 / (2 * 9) * sum(probs[:, i].sum() * counts[i] for i in range(4))
    assert torch.allclose(got, want)
    # perfectly balanced uniform routing gives coeff exactly
    uniform = torch.full((4, 4), 0.25)
    assert torch.allclose(routing.switch_load_balancing_loss(
        uniform, torch.full((4,), 2.0), 4, 2, 4, 0.1), torch.tensor(0.1))


def test_z_loss_definition():
    got = routing.z_loss(LOGITS, 0.01)
    want = 0.01 * torch.logsumexp(LOGITS, -1).pow(2).mean()
    assert torch.allclose(got, want)


def test_capacity_and_probs_drop_policy():
    # 3 tokens x top-2 over 4 experts, factor 1: capacity ceil(6/4) = 2
    assert routing.capacity(6, 4, 1.0) == 2
    probs = torch.tensor([[0.6, 0.4, 0, 0], [0.7, 0.3, 0, 0], [0.9, 0.1, 0, 0]])
    routing_map = probs > 0
    kept, kept_map = routing.apply_token_dropping(probs, routing_map, 2, 1.0, "probs")
    assert kept_map[:, 0].tolist() == [False, True, True]  # the two highest weights keep
    assert kept_map[:, 1].tolist() == [True, True, False]
    assert torch.equal(kept, probs * kept_map)


def test_position_drop_policy_keeps_the_earliest():
    probs = torch.tensor([[0.6, 0.4, 0, 0], [0.7, 0.3, 0, 0], [0.9, 0.1, 0, 0]])
    _, kept_map = routing.apply_token_dropping(probs, probs > 0, 2, 1.0, "position")
    assert kept_map[:, 0].tolist() == [True, True, False]


def test_position_drop_ranks_sequence_major_with_several_sequences():
    # 2 sequences x 3 positions, rows batch-major (row = b * 3 + s); every token wants expert
    # 0 (top-1 of 2 experts, factor 1): capacity ceil(6 x 1 / 2) = 3. Megatron ranks its
    # [s, b] rows: (s0,b0) (s0,b1) (s1,b0) (s1,b1) ..., so it keeps position 0 of both
    # sequences and position 1 of the first: rows 0, 3, 1 -- not the whole first sequence.
    probs = torch.tensor([[1.0, 0.0]] * 6)
    _, kept = routing.apply_token_dropping(probs, probs > 0, 1, 1.0, "position", batch_size=2)
    assert kept[:, 0].tolist() == [True, True, False, True, False, False]
    # one sequence of 6: the first three positions
    _, kept = routing.apply_token_dropping(probs, probs > 0, 1, 1.0, "position", batch_size=1)
    assert kept[:, 0].tolist() == [True, True, True, False, False, False]


def test_position_drop_with_three_sequences_keeps_the_earliest_of_each():
    # 3 sequences x 4 positions, top-1 of 4 experts, factor 2: capacity ceil(12/4 x 2) = 6.
    # Sequence i sends all its tokens to expert 0 except position 1 of sequence 1 (expert 1).
    # Sequence-major order of expert 0's tokens: (p0: b0 b1 b2) (p1: b0 b2) (p2: b0 ...), so
    # the six kept are p0 of all three, p1 of b0 and b2, p2 of b0.
    probs = torch.zeros(12, 4)
    probs[:, 0] = 1.0
    probs[1 * 4 + 1] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    _, kept = routing.apply_token_dropping(probs, probs > 0, 1, 2.0, "position", batch_size=3)
    want = torch.zeros(3, 4, dtype=torch.bool)  # [b, s]
    want[:, 0] = True
    want[0, 1] = want[2, 1] = want[0, 2] = True
    assert kept[:, 0].tolist() == want.flatten().tolist()
    assert kept[:, 1].tolist() == [r == 5 for r in range(12)]  # under capacity: kept


def test_position_padding_fills_with_the_earliest_unrouted_sequence_major():
    # 2 x 2 tokens, top-1 of 2 experts, factor 1: capacity 2 per expert. In [s, b] order the
    # rows go 0, 2, 1, 3: expert 0 (only row 3 routed) is padded with row 0; expert 1 (rows 0,
    # 1, 2 routed) keeps rows 0 and 2 -- position 0 of both sequences.
    probs = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    kept_probs, kept = routing.apply_token_dropping(probs, probs > 0, 1, 1.0, "position",
                                                    pad_to_capacity=True, batch_size=2)
    assert kept[:, 0].tolist() == [True, False, False, True]  # routed row 3, then row 0
    assert kept[:, 1].tolist() == [True, False, True, False]  # rows 0, 2 (of 0, 1, 2)
    assert torch.equal(kept_probs, probs * kept)


def test_probs_drop_is_the_same_in_either_layout():
    # The probs policy ranks by weight, so (without ties) it keeps the same (token, expert)
    # pairs whichever way the rows are ordered.
    torch.manual_seed(3)
    b, s = 3, 5
    probs, routing_map = routing.topk_routing(torch.randn(b * s, 4), topk=2)
    got = routing.apply_token_dropping(probs, routing_map, 2, 0.5, "probs", batch_size=b)
    seq_major = routing.sequence_major(probs, b)
    plain = routing.apply_token_dropping(seq_major, seq_major > 0, 2, 0.5, "probs")
    assert torch.equal(got[1], routing.batch_major(plain[1], b))
    assert torch.equal(routing.batch_major(routing.sequence_major(probs, b), b), probs)


def test_pad_to_capacity_fills_every_expert():
    probs = torch.tensor([[0.6, 0.4, 0, 0], [0.7, 0.3, 0, 0], [0.9, 0.1, 0, 0]])
    kept, kept_map = routing.apply_token_dropping(probs, probs > 0, 2, 1.0, "probs",
                                                  pad_to_capacity=True)
    assert kept_map.sum(0).tolist() == [2, 2, 2, 2]
    assert kept[:, 2:].abs().sum() == 0  # padded-in tokens carry no weight


def test_expert_bias_update_is_sign_of_the_gap_to_the_mean():
    counts = torch.tensor([4.0, 0.0, 2.0, 2.0])
    got = routing.updated_expert_bias(counts, torch.zeros(4), 0.01)
    assert got.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


# ---------------------------------------------------------------- megatron-core, if installed

def _megatron():
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception:  # noqa: BLE001 - not installed, or its optional kernels missing
        pytest.skip("megatron-core is not installed")
    return moe_utils


@pytest.mark.parametrize("kwargs", [
    {}, {"use_pre_softmax": True}, {"score_function": "sigmoid"},
    {"score_function": "sigmoid", "expert_bias": torch.tensor([0.3, -0.2, 0.1, 0.0])},
    {"num_groups": 2, "group_topk": 1}, {"scaling_factor": 1.7}])
def test_topk_routing_equals_megatron_core(kwargs):
    mu = _megatron()
    torch.manual_seed(0)
    logits = torch.randn(16, 4)
    want = mu.topk_routing_with_score_function(logits, 2, **kwargs)
    ours = dict(kwargs)
    if "use_pre_softmax" in ours:
        ours["pre_softmax"] = ours.pop("use_pre_softmax")
    got = routing.topk_routing(logits, 2, **ours)
    assert torch.allclose(got[0], want[0]) and torch.equal(got[1], want[1])


def test_losses_and_dropping_equal_megatron_core():
    mu = _megatron()
    torch.manual_seed(1)
    logits = torch.randn(16, 4)
    probs = torch.softmax(logits, -1)
    counts = torch.tensor([5.0, 9.0, 10.0, 8.0])
    assert torch.allclose(routing.switch_load_balancing_loss(probs, counts, 16, 2, 4, 0.1),
                          mu.switch_load_balancing_loss_func(probs, counts, 16, 2, 4, 0.1))
    assert torch.allclose(routing.z_loss(logits, 0.01), mu.z_loss_func(logits, 0.01))
    p, m = routing.topk_routing(logits, 2)
    for pad in (False, True):
        got = routing.apply_token_dropping(p, m, 2, 0.5, "probs", pad)
        want = mu.apply_router_token_dropping(p, m, 2, 0.5, "probs", pad)
        assert torch.allclose(got[0], want[0]) and torch.equal(got[1], want[1])
