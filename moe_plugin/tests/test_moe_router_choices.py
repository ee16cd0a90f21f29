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
from plugtron_moe.options import load_balancing
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


# ---------------------------------------------------------------- several balancing losses

def _parse(args):
    """The config `plugtron train ARGS` would run (parsed as the train command parses)."""
    import click
    from plugtron.cli.options import (
        SectionedCommand,
        build_config,
        config_options,
        declared_sections,
        prescan,
    )

    declared = declared_sections(prescan(args))
    seen = {}

    @click.command(cls=SectionedCommand)
    @click.option("--config", "config_file")
    @config_options(declared)
    def command(config_file, **params):
        seen["config"] = build_config(params, config_file, None, declared=declared)

    result = CliRunner().invoke(command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen["config"]


def test_several_types_and_coefficients_after_one_flag_as_megatron():
    config = _parse(["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss",
                     "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2", "1e-3", "--seq-length",
                     "16"])
    assert config.moe.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]
    assert load_balancing(config.moe) == [("aux_loss", 1e-2, "load_balancing_loss"),
                                          ("seq_aux_loss", 1e-3, "seq_load_balancing_loss")]
    assert config.model.seq_length == 16  # the values stop at the next flag
    # repeating the flag says the same
    again = _parse(["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss",
                    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
                    "1e-2", "--moe-aux-loss-coeff", "1e-3"])
    assert load_balancing(again.moe) == load_balancing(config.moe)


def test_one_type_reads_as_before():
    assert load_balancing(tiny_config(num_experts=4).moe) == []  # coefficient 0: off
    for moe in (_parse(["--num-experts", "4", "--moe-router-load-balancing-type",
                        "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"]).moe,
                tiny_config(num_experts=4, moe_router_load_balancing_type="seq_aux_loss",
                            moe_aux_loss_coeff=0.01).moe):
        assert load_balancing(moe) == [("seq_aux_loss", 0.01, "load_balancing_loss")]
    # a config of an older checkpoint holds single values, not lists
    old = tiny_config(num_experts=4).moe
    old.moe_router_load_balancing_type, old.moe_aux_loss_coeff = "global_aux_loss", 0.1
    assert load_balancing(old) == [("global_aux_loss", 0.1, "load_balancing_loss")]
    old.moe_router_load_balancing_type = "none"
    assert load_balancing(old) == []


def test_zero_coefficient_and_none_in_a_list_add_nothing():
    moe = tiny_config(num_experts=4, moe_router_load_balancing_type=["aux_loss", "none",
                                                                      "global_aux_loss"],
                      moe_aux_loss_coeff=[0.0, 1.0, 0.5]).moe
    assert load_balancing(moe) == [("global_aux_loss", 0.5, "global_load_balancing_loss")]


@pytest.mark.parametrize("extra,message", [
    (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
      "1e-2"], "gives 1 coefficient(s) for 2 --moe-router-load-balancing-type(s) (aux_loss "
               "seq_aux_loss): give one coefficient per type"),
    (["--moe-aux-loss-coeff", "1e-2", "1e-3"], "gives 2 coefficient(s) for 1"),
    (["--moe-router-load-balancing-type", "aux_loss", "aux_loss", "--moe-aux-loss-coeff",
      "1e-2", "1e-3"], "names a type twice"),
    (["--moe-router-load-balancing-type", "aux_loss", "nosuch", "--moe-aux-loss-coeff",
      "1e-2", "1e-3"], "'nosuch' is not one of 'aux_loss', 'seq_aux_loss'"),
    (["--moe-aux-loss-coeff", "abc"], "--moe-aux-loss-coeff 'abc' is not a number"),
])
def test_lists_that_do_not_pair_up_exit_2(extra, message):
    result = invoke(extra)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_each_balancing_loss_is_its_own_term_with_its_own_coefficient():
    from plugtron.api import ParallelContext
    from plugtron_moe.router import TopKRouter

    def router(types, coeffs):
        config = tiny_config(num_experts=4, moe_router_topk=2,
                             moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs)
        torch.manual_seed(0)
        r = TopKRouter(config, ParallelContext.build(1, 0), "r", 0, 1)
        r._seq_shape = (5, 2)
        return r

    x = torch.randn(10, 32)
    both = dict(router(["aux_loss", "seq_aux_loss"], [1e-2, 1e-3])(x)[2])
    alone = dict(router("aux_loss", 1e-2)(x)[2])
    seq = dict(router("seq_aux_loss", 1e-3)(x)[2])
    assert set(both) == {"load_balancing_loss", "seq_load_balancing_loss"}
    torch.testing.assert_close(both["load_balancing_loss"], alone["load_balancing_loss"])
    torch.testing.assert_close(both["seq_load_balancing_loss"], seq["load_balancing_loss"])


def test_training_with_two_balancing_losses_reports_both():
    from tests.utils import train_in_process

    config = tiny_config(num_experts=4, moe_router_topk=2, train_iters=2,
                         moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                         moe_aux_loss_coeff=[1e-2, 1e-3], moe_router_score_function="sqrtsoftplus")
    records, _ = train_in_process(config)
    for record in records:
        assert record["load_balancing_loss"] > 0 and record["global_load_balancing_loss"] > 0


def test_a_config_file_list_is_checked_value_by_value(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("num-experts: 4\nmoe-router-load-balancing-type: [aux_loss, seq_aux_loss]\n"
                    "moe-aux-loss-coeff: [0.01, 0.001]\n")
    config = _parse(["--config", str(good)])
    assert load_balancing(config.moe) == [("aux_loss", 0.01, "load_balancing_loss"),
                                          ("seq_aux_loss", 0.001, "seq_load_balancing_loss")]
    bad = tmp_path / "bad.yaml"
    bad.write_text("num-experts: 4\nmoe-router-load-balancing-type: [aux_loss, nosuch]\n"
                   "moe-aux-loss-coeff: [0.01, 0.001]\n")
    result = invoke(["--config", str(bad)])
    assert result.exit_code == 2, result.output
    assert "'nosuch' is not one of aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none" in \
        result.output


# ---------------------------------------------------------------- sinkhorn

def test_sinkhorn_balances_rows_and_columns():
    torch.manual_seed(0)
    cost = torch.randn(12, 4) * 3
    balanced = routing.sinkhorn(cost)
    # each row sums to 1/tokens exactly after the row step; the columns to ~1/experts
    torch.testing.assert_close(balanced.sum(1), torch.full((12,), 1 / 12), rtol=1e-3,
                               atol=1e-6)
    torch.testing.assert_close(balanced.sum(0), torch.full((4,), 1 / 4), rtol=1e-2, atol=1e-3)
    # the balanced matrix is exp(cost) scaled by a row and a column factor
    ratio = balanced / torch.exp(cost)
    torch.testing.assert_close(ratio / ratio[:, :1], (ratio[0] / ratio[0, 0]).expand(12, 4))


def test_sinkhorn_routing_spreads_tokens_that_all_prefer_one_expert():
    torch.manual_seed(1)
    logits = torch.randn(16, 4) * 0.1
    logits[:, 0] += 2.0  # every token prefers expert 0
    logits.requires_grad_()
    plain_map = routing.topk_routing(logits.detach(), topk=2, pre_softmax=True)[1]
    assert plain_map[:, 0].all()
    probs, routing_map = routing.sinkhorn_routing(logits, topk=2, balance=True)
    assert routing_map.sum(1).tolist() == [2] * 16
    assert routing_map.sum(0).max() < 16  # expert 0 no longer takes every token
    # the weights are the softmax over all experts at the chosen ones; the choice has no
    # gradient, the weights do
    full = torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(probs.detach(), full * routing_map)
    (probs * torch.arange(4.0)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_sinkhorn_top1_weighs_by_sigmoid_and_eval_picks_the_best_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    probs, routing_map = routing.sinkhorn_routing(logits, topk=1, balance=False)
    assert routing_map.tolist() == [[True, False, False, False], [False, True, False, False]]
    torch.testing.assert_close(probs, torch.sigmoid(logits) * routing_map)


def test_sinkhorn_router_balances_in_training_only():
    from plugtron.api import ParallelContext
    from plugtron_moe.router import TopKRouter

    config = tiny_config(num_experts=4, moe_router_topk=2,
                         moe_router_load_balancing_type="sinkhorn")
    validate(config, 1)
    router = TopKRouter(config, ParallelContext.build(1, 0), "r", 0, 1)
    x = torch.randn(16, 32)
    logits = x @ router.weight.detach().t()
    probs, routing_map, aux = router(x)
    assert aux == []  # sinkhorn adds no balancing loss
    want = routing.sinkhorn_routing(logits, 2, balance=True)
    torch.testing.assert_close(probs.detach(), want[0])
    assert torch.equal(routing_map, want[1])
    router.eval()
    _, routing_map, _ = router(x)
    assert torch.equal(routing_map, routing.sinkhorn_routing(logits, 2, balance=False)[1])


def test_sinkhorn_top1_needs_no_pre_softmax():
    validate(tiny_config(num_experts=4, moe_router_topk=1,
                         moe_router_load_balancing_type="sinkhorn"), 1)


@pytest.mark.parametrize("extra,message", [
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "1e-2"],
     "sinkhorn balances by routing and takes no balancing loss"),
    (["--moe-router-load-balancing-type", "sinkhorn", "aux_loss", "--moe-aux-loss-coeff", "0",
      "1e-2"], "sinkhorn is a way of routing, not a loss to add"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-expert-capacity-factor", "1"],
     "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss, global_aux_loss or none, "
     "not sinkhorn"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-router-score-function", "sigmoid"],
     "sinkhorn does not use --moe-router-score-function sigmoid"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-router-pre-softmax"],
     "sinkhorn does not use --moe-router-pre-softmax"),
])
def test_sinkhorn_refusals_exit_2(extra, message):
    result = invoke(extra)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_training_with_sinkhorn_routing():
    from tests.utils import train_in_process

    config = tiny_config(num_experts=4, moe_router_topk=2, train_iters=2,
                         moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=1e-3)
    records, _ = train_in_process(config)
    assert len(records) == 2 and all(r["z_loss"] > 0 for r in records)
    assert not any("load_balancing_loss" in r for r in records)


def test_a_sinkhorn_model_is_not_exported_as_mixtral():
    from plugtron_moe.hf_convert import MoEConverter

    config = tiny_config(num_experts=4, moe_router_load_balancing_type="sinkhorn",
                         normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    with pytest.raises(ConfigError, match="trained with --moe-router-load-balancing-type "
                                          "sinkhorn"):
        MoEConverter().export_hf_from(config, {})
