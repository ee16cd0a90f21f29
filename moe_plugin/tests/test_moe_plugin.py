"""plugtron-moe in one process: options and refusals, which layers become MoE, parameter
names, grouped vs looped experts, a third-party dispatcher, expert-bias updates."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.contracts.layers import substitute_symbols
from plugtron.core.training.loop import setup
from plugtron_moe.options import moe_layer_pattern

from tests.fake_plugins import install_fake_distribution, remove_path
from tests.utils import tiny_config, train_in_process

ARGS = ["--data", "mock", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--vocab-size", "64", "--no-progress", "--eval-interval", "0"]
MOE = {"num_experts": 4, "moe_router_topk": 2}


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_help_lists_the_moe_flags():
    out = invoke(["train", "--help"]).output
    assert "Mixture of experts (plugtron-moe 0.1.0)" in out
    # Every flag the issue names, with Megatron's spelling.
    for flag in ("--num-experts", "--moe-ffn-hidden-size", "--moe-layer-freq",
                 "--moe-router-topk", "--moe-router-score-function", "--moe-router-pre-softmax",
                 "--moe-router-num-groups", "--moe-router-group-topk",
                 "--moe-router-topk-scaling-factor", "--moe-router-load-balancing-type",
                 "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", "--moe-router-dtype", "--moe-input-jitter-eps",
                 "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity",
                 "--moe-token-drop-policy", "--moe-shared-expert-intermediate-size",
                 "--moe-shared-expert-gate", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
                 "--moe-per-layer-logging", "--expert-model-parallel-size",
                 "--expert-tensor-parallel-size"):
        assert flag in out, flag


@pytest.mark.parametrize("extra,message", [
    (["--num-experts", "3", "--ep", "2"], "not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
     "needs --moe-expert-capacity-factor"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "nosuch"],
     "unknown moe_dispatcher 'nosuch'; available: allgather (plugtron-moe 0.1.0), alltoall"),
    (["--num-experts", "4", "--ep", "4", "--pp", "2"], "not divisible by etp 1 x ep 4 x pp 2"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], "gives 3 layers"),
    (["--num-experts", "4", "--tp", "2", "--etp", "1", "--seq-length", "15",
      "--micro-batch-size", "1"], "needs them divisible by 2"),
    (["--num-experts", "4", "--etp", "2", "--moe-ffn-hidden-size", "15"],
     "--moe-ffn-hidden-size 15 is not divisible by the expert tensor-parallel size 2"),
    (["--num-experts", "4", "--squared-relu"], "--squared-relu is not supported for MoE"),
])
def test_bad_combinations_exit_2_before_launch(extra, message):
    result = invoke(["train", *ARGS, "--nproc-per-node", "2", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_layer_freq_int_and_list_expression():
    assert moe_layer_pattern("1", 3) == [True, True, True]
    assert moe_layer_pattern(2, 4) == [True, False, True, False]
    assert moe_layer_pattern("([0]+[1]*3)*2", 8) == [False, True, True, True] * 2


def test_gpt_asks_the_registry_which_layers_are_moe():
    config = tiny_config(num_layers=4, moe_layer_freq="[0,1,1,0]", **MOE)
    assert substitute_symbols("*-", config, [1, 2, 3, 4]) == {1: "*-", 2: "*E", 3: "*E",
                                                              4: "*-"}
    assert substitute_symbols("*-", tiny_config(), [1]) == {1: "*-"}  # no --num-experts


def test_parameter_names_are_megatron_cores():
    config = tiny_config(moe_layer_freq="[0,1]", moe_shared_expert_intermediate_size=16,
                         moe_shared_expert_gate=True, **MOE)
    names = {n for n, _ in setup(config).model_chunks[0].module.named_parameters()}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # dense layer 0
    assert "decoder.layers.1.mlp.router.weight" in names
    for e in range(4):
        assert f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight" in names
        assert f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.bias" in names
    assert {"decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
            "decoder.layers.1.mlp.shared_experts.gate_weight"} <= names


def _moe_output_and_grads(grouped: bool, swiglu: bool):
    config = tiny_config(moe_grouped_gemm=grouped, swiglu=swiglu, num_experts=4,
                         moe_router_topk=3)
    run = setup(config)
    layer = run.model_chunks[0].module.decoder.layers["0"]
    mlp = layer.mlp
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    out, _ = mlp(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_and_looped_experts_give_the_same_numbers(swiglu):
    """Tolerance 1e-6 (fp32; the batched matmul sums in another order)."""
    looped, grouped = _moe_output_and_grads(False, swiglu), _moe_output_and_grads(True, swiglu)
    assert torch.allclose(looped[0], grouped[0], atol=1e-6)
    assert torch.allclose(looped[1], grouped[1], atol=1e-6)
    assert looped[2].keys() == grouped[2].keys()
    for name in looped[2]:
        assert torch.allclose(looped[2][name], grouped[2][name], atol=1e-6), name


COUNTING_DISPATCHER = """
from plugtron_moe import TokenDispatcher
from plugtron_moe.dispatchers.allgather import AllGatherDispatcher

CALLS = {"dispatch": 0, "combine": 0}

class CountingDispatcher(AllGatherDispatcher):
    name = "counting"

    def dispatch(self, hidden, probs, routing_map):
        CALLS["dispatch"] += 1
        return super().dispatch(hidden, probs, routing_map)

    def combine(self, expert_output, dispatched):
        CALLS["combine"] += 1
        return super().combine(expert_output, dispatched)

assert issubclass(CountingDispatcher, TokenDispatcher)
"""


@pytest.fixture()
def third_party_dispatcher(tmp_path):
    install_fake_distribution(tmp_path, "plugtron-counting", "0.3",
                              {"plugtron.moe_dispatchers": {"counting": "fake_counting:"
                                                                        "CountingDispatcher"}},
                              {"fake_counting": COUNTING_DISPATCHER})
    yield
    remove_path(tmp_path)


def test_a_third_party_dispatcher_is_selected_by_name(third_party_dispatcher):
    import fake_counting

    config = tiny_config(moe_token_dispatcher_type="counting", train_iters=2, **MOE)
    train_in_process(config)
    # 2 layers x 2 iterations x 4 microbatches, one dispatch and one combine each
    assert fake_counting.CALLS == {"dispatch": 16, "combine": 16}
    assert "plugtron-counting" in invoke(["plugins", "list"]).output


def test_expert_bias_moves_after_each_step_and_is_saved():
    config = tiny_config(moe_router_score_function="sigmoid",
                         moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
                         train_iters=2, **MOE)
    _, run = train_in_process(config)
    layers = run.model_chunks[0].module.decoder.layers
    biases = torch.stack([layers[i].mlp.router.expert_bias for i in ("0", "1")])
    assert biases.abs().max() > 0
    # 2 updates of +-0.01 each (0 where a count equals the mean)
    assert torch.allclose(biases * 100, (biases * 100).round(), atol=1e-4)
    assert biases.abs().max() <= 0.02 + 1e-6
    state = run.model_chunks[0].module.state_dict()
    assert "decoder.layers.0.mlp.router.expert_bias" in state
    assert "decoder.layers.0.mlp.router.local_tokens_per_expert" not in state


def test_aux_losses_are_logged_per_layer_when_asked():
    config = tiny_config(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                         moe_per_layer_logging=True, train_iters=1, **MOE)
    records, _ = train_in_process(config)
    record = records[-1]
    assert record["load_balancing_loss"] > 0 and record["z_loss"] > 0
    per_layer = record["load_balancing_loss_layer_1"] + record["load_balancing_loss_layer_2"]
    assert per_layer == pytest.approx(record["load_balancing_loss"], rel=1e-6)


def test_topology_shows_the_expert_groups():
    out = invoke(["topology", "--world-size", "4", "--ep", "2"]).output
    assert "ep=2" in out and "edp=2" in out
    assert "ep: [0, 1] [2, 3]" in out and "edp: [0, 2] [1, 3]" in out


#: The collectives the MoE code calls, by the module that imports each (patched there: with
#: one process they return at once, so only the recorded arguments tell where they live).
_COLLECTIVES = {
    "plugtron_moe.dispatchers.alltoall": ("all_to_all", "all_to_all_counts"),
    "plugtron_moe.dispatchers.allgather": ("all_gather_tensor",
                                           "gather_from_sequence_parallel_region",
                                           "reduce_scatter_to_sequence_parallel_region"),
    "plugtron_moe.router": ("all_reduce",),
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_collective_gets_tensors_on_the_tokens_device(dispatcher, device, monkeypatch):
    """nccl exchanges device tensors only, so a count or statistic built on the CPU fails
    there (gloo on CPU takes anything). Every tensor the MoE layer hands a collective must
    be on the tokens' device. (Only a CUDA machine can catch a CPU tensor here.)"""
    import importlib

    from plugtron.core.parallel.distributed import single_process

    seen = []

    def recording(fn, name):
        def call(*args, **kwargs):
            seen.extend((name, a.device) for a in args if isinstance(a, torch.Tensor))
            return fn(*args, **kwargs)
        return call

    for module_name, names in _COLLECTIVES.items():
        module = importlib.import_module(module_name)
        for name in names:
            monkeypatch.setattr(module, name, recording(getattr(module, name), name))
    config = tiny_config(moe_token_dispatcher_type=dispatcher,
                         moe_router_load_balancing_type="global_aux_loss",
                         moe_aux_loss_coeff=0.01, **MOE)
    run = setup(config, world=single_process(device))
    mlp = run.model_chunks[0].module.decoder.layers["0"].mlp
    x = torch.randn(2, 16, 32, device=device, requires_grad=True)
    out, aux = mlp(x)
    (out.square().sum() + sum(loss for _, loss in aux)).backward()
    names = {name for name, _ in seen}
    assert "all_reduce" in names and ("all_to_all_counts" in names) == (dispatcher == "alltoall")
    wrong = [(name, d) for name, d in seen if d != x.device]
    assert not wrong, f"collectives given tensors off {x.device}: {wrong}"
