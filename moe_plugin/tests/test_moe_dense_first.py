"""Dense layers first, MoE after (issue 27): ``--moe-layer-freq`` as Megatron parses it (an int,
or a list expression such as ``([0]*3+[1]*58)``), evaluated by reading the expression, never by
running it; and a tiny DeepSeek-V3-shaped model (multi-latent attention, two dense layers then
two MoE layers with sigmoid routing, expert bias, group-limited top-k, a routed scaling factor
and a shared expert) trains like one process under ep 2 with each dispatcher and under pp 2 x
ep 2 (the dense layers on one stage, the MoE layers on the other). fp32, relative 1e-5 on the
loss, grad norm and balancing loss. One pool of 4 ranks for the module."""

from __future__ import annotations

import pytest
from plugtron.api import ConfigError
from plugtron.testing import assert_records_close, train_run
from plugtron.testing.config import merge_flags
from plugtron_moe.options import moe_layer_pattern


def test_deepseek_v3_pattern_and_megatron_forms():
    assert moe_layer_pattern("([0]*3+[1]*58)", 61) == [False] * 3 + [True] * 58
    assert moe_layer_pattern("[0]*1+[1]*3", 4) == [False, True, True, True]
    assert moe_layer_pattern("[1, 0, 1]", 3) == [True, False, True]
    assert moe_layer_pattern("2*[0, 1]", 4) == [False, True, False, True]
    assert moe_layer_pattern(3, 7) == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("text,message", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("[0]*10**9", "BinOp"),  # ** is not evaluated at all
    ("[0]*(1000*1000)", "a count past"),
    ("[0]*100000+[1]*100000", "grows past"),
    ("[[0, 1]]", "may not be nested"),
    ("[0]+1", "'+' joins two lists"),
    ("[x for x in (0, 1)]", "ListComp is not allowed"),
    ("'01'", "Constant is not allowed"),
    ("[0, 2]", "must give a list of 0/1"),
    ("[0,", "expected an int or a list expression"),
])
def test_anything_but_a_list_expression_is_refused_unevaluated(text, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("(", r"\(")
                       .replace("+", r"\+").replace("[", r"\[")):
        moe_layer_pattern(text, 4)


FLAGS = {"num-layers": 4, "moe-layer-freq": "([0]*2+[1]*2)", "num-experts": 4,
         "moe-router-topk": 2, "moe-router-score-function": "sigmoid",
         "moe-router-enable-expert-bias": True, "moe-router-num-groups": 2,
         "moe-router-group-topk": 1, "moe-router-topk-scaling-factor": 2.5,
         "moe-shared-expert-intermediate-size": 16, "moe-ffn-hidden-size": 16,
         "moe-router-load-balancing-type": "seq_aux_loss", "moe-aux-loss-coeff": 0.001,
         "swiglu": True, "normalization": "RMSNorm", "add-bias-linear": False,
         "position-embedding-type": "rope", "multi-latent-attention": True,
         "q-lora-rank": 12, "kv-lora-rank": 8, "qk-head-dim": 6, "qk-pos-emb-head-dim": 4,
         "v-head-dim": 5, "train-iters": 3}
KEYS = ("lm_loss", "grad_norm", "load_balancing_loss")
LAYOUTS = {
    "ep2-allgather": {"expert-model-parallel-size": 2, "dp": 2},
    "ep2-alltoall": {"expert-model-parallel-size": 2, "dp": 2,
                     "moe-token-dispatcher-type": "alltoall"},
    "pp2-ep2": {"expert-model-parallel-size": 2, "dp": 2, "pp": 2},
}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4)


@pytest.fixture(scope="module")
def one_process(pool):
    return train_run(FLAGS, world_size=1, pool=pool).records


def test_dense_then_moe_layers_are_built_where_the_pattern_says(pool):
    from plugtron.api import substitute_symbols
    from plugtron.testing import make_config
    plan = substitute_symbols("*-", make_config(FLAGS), [1, 2, 3, 4])
    assert plan == {1: "*-", 2: "*-", 3: "*E", 4: "*E"}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_train_like_one_process(name, pool, one_process):
    got = train_run(merge_flags(FLAGS, LAYOUTS[name]), pool=pool).records
    assert_records_close(got, one_process, 1e-5, f"{name} vs one process", keys=KEYS)
