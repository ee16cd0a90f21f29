"""Router choices Megatron-Core has and refuses, checked without megatron-core: the top-1
refusal, the sqrtsoftplus score function, several balancing losses at once, sinkhorn."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from plugtron.api import ConfigError
from plugtron.cli.main import cli
from plugtron_moe import routing
from plugtron_moe.validate import validate

from tests.utils import tiny_config

ARGS = ["--data", "mock", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
        "--vocab-size", "64", "--no-progress", "--eval-interval", "0", "--num-experts", "4"]


def invoke(args):
    return CliRunner().invoke(cli, ["train", *ARGS, *args], catch_exceptions=False)


# ---------------------------------------------------------------- top-1 with softmax after top-k

def test_top1_with_softmax_after_topk_exits_2_naming_the_fix():
    result = invoke(["--moe-router-topk", "1"])
    assert result.exit_code == 2, result.output
    assert "--moe-router-topk 1 with softmax after top-k" in result.output
    assert "add --moe-router-pre-softmax" in result.output
    assert "--moe-router-score-function sigmoid" in result.output


@pytest.mark.parametrize("flags", [{"moe_router_pre_softmax": True},
                                   {"moe_router_score_function": "sigmoid"}])
def test_top1_is_accepted_with_pre_softmax_or_sigmoid(flags):
    validate(tiny_config(num_experts=4, moe_router_topk=1, **flags), 1)


def test_top1_refusal_through_validate():
    with pytest.raises(ConfigError, match="add --moe-router-pre-softmax"):
        validate(tiny_config(num_experts=4, moe_router_topk=1), 1)


# ---------------------------------------------------------------- sqrtsoftplus

def _sqrtsoftplus(x: float) -> float:
    return math.sqrt(math.log1p(math.exp(x)))


def test_sqrtsoftplus_weights_are_the_normalised_scores_of_the_chosen():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]], requires_grad=True)
    probs, routing_map = routing.topk_routing(logits, topk=2, score_function="sqrtsoftplus")
    # token 0 picks experts 0 and 1, token 1 experts 1 and 3 (the score is increasing)
    assert routing_map.tolist() == [[True, True, False, False], [False, True, False, True]]
    a, b = _sqrtsoftplus(2.0), _sqrtsoftplus(1.0)
    assert probs[0].tolist() == pytest.approx([a / (a + b), b / (a + b), 0, 0], rel=1e-6)
    # the gradient flows through the chosen scores (autograd of the hand formula)
    (probs[:, 0] * 3 + probs[:, 1]).sum().backward()
    want = logits.detach().clone().requires_grad_()
    s = torch.sqrt(torch.nn.functional.softplus(want))
    p0 = s[0, :2] / s[0, :2].sum()
    p1 = s[1, [1, 3]] / s[1, [1, 3]].sum()
    (p0[0] * 3 + p0[1] + p1[0]).backward()
    torch.testing.assert_close(logits.grad, want.grad, rtol=1e-6, atol=1e-7)


def test_sqrtsoftplus_top1_is_the_unnormalised_score_and_bias_only_chooses():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs, _ = routing.topk_routing(logits, topk=1, score_function="sqrtsoftplus")
    assert probs[0, 0].item() == pytest.approx(_sqrtsoftplus(2.0), rel=1e-6)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    probs, routing_map = routing.topk_routing(logits, topk=1, score_function="sqrtsoftplus",
                                              expert_bias=bias)
    assert routing_map[0].tolist() == [False, False, False, True]
    assert probs[0, 3].item() == pytest.approx(_sqrtsoftplus(-1.0), rel=1e-6)


def test_sqrtsoftplus_balancing_scores_are_normalised_over_all_experts():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    routing_map, scores = routing.scores_for_aux_loss(logits, 2, "sqrtsoftplus")
    raw = [_sqrtsoftplus(v) for v in logits[0].tolist()]
    assert scores[0].tolist() == pytest.approx([v / sum(raw) for v in raw], rel=1e-6)
    assert routing_map[0].tolist() == [True, True, False, False]


def test_sqrtsoftplus_with_expert_bias_validates_and_softmax_with_bias_does_not():
    validate(tiny_config(num_experts=4, moe_router_score_function="sqrtsoftplus",
                         moe_router_enable_expert_bias=True, moe_router_topk=1), 1)
    with pytest.raises(ConfigError, match="sigmoid or sqrtsoftplus"):
        validate(tiny_config(num_experts=4, moe_router_enable_expert_bias=True), 1)
