"""Router choices Megatron-Core has and refuses, checked without megatron-core: the top-1
refusal, the sqrtsoftplus score function, several balancing losses at once, sinkhorn."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from plugtron.api import ConfigError
from plugtron.cli.main import cli
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
