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
