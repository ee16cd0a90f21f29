"""The data-parallel wrapper role: which wrapper a run selects, what fsdp2 refuses before
launch, the contract a wrapper's chunk must follow, and how the estimate counts each."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.plugins.selection import resolve_data_parallel, resolve_optimizer
from plugtron.core.tools.estimate import estimate_memory
from plugtron.core.training.loop import checked_chunk
from plugtron.plugins.data_parallel import fsdp2

from tests.utils import tiny_config

TINY = ["--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters", "2",
        "--no-progress", "--eval-interval", "0", "--hidden-dropout", "0"]


@pytest.mark.parametrize("overrides,wrapper,optimizer", [
    ({}, "ddp", "adam"),
    ({"use_torch_fsdp2": True}, "fsdp2", "adam"),
    ({"data_parallel_sharding_strategy": "optim_grads_params"}, "fsdp2", "adam"),
    ({"data_parallel_sharding_strategy": "optim"}, "ddp", "distributed-adam"),
    ({"data_parallel_sharding_strategy": "no_shard"}, "ddp", "adam"),
])
def test_the_flags_select_a_wrapper_and_optimizer(overrides, wrapper, optimizer):
    config = tiny_config(**overrides)
    assert resolve_data_parallel(config) == wrapper
    assert resolve_optimizer(config) == optimizer


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


@pytest.mark.parametrize("args,message", [
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 on one rank shards nothing"),
    (["--use-torch-fsdp2", "--use-distributed-optimizer"],
     "--use-distributed-optimizer (distributed-adam) is redundant"),
    (["--use-torch-fsdp2", "--optimizer", "distributed-adam"], "is redundant"),
    (["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim"],
     "for optim use the ddp wrapper with --use-distributed-optimizer"),
    (["--data-parallel-sharding-strategy", "optim_grads"],
     "gradients alone (ZeRO-2) are not offered"),
    (["--use-torch-fsdp2", "--overlap-param-gather"], "drop it"),
    (["--use-torch-fsdp2", "--data-parallel", "ddp"], "cannot be combined with --data-parallel"),
    (["--data-parallel", "zero3"], "unknown data_parallel 'zero3'; available: ddp"),
    (["--data-parallel-sharding-strategy", "all"], "Invalid value"),
])
def test_bad_data_parallel_input_exits_2(args, message):
    ranks = [] if args == ["--use-torch-fsdp2"] else ["--nproc-per-node", "2"]
    result = invoke(["train", *TINY, *ranks, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_fsdp2_refuses_an_optimizer_that_cannot_step_dtensors(monkeypatch):
    monkeypatch.setattr(fsdp2, "optimizer_takes_dtensor_params", lambda config: False)
    with pytest.raises(ConfigError, match="does not say it can step DTensor parameters"):
        fsdp2.FSDP2().plugtron_validate(tiny_config(use_torch_fsdp2=True), 2)


def test_fsdp2_refuses_a_torch_without_fully_shard(monkeypatch):
    monkeypatch.setattr(fsdp2, "fully_shard", None)
    with pytest.raises(ConfigError, match="lacks: install torch >= 2.6"):
        fsdp2.FSDP2().plugtron_validate(tiny_config(use_torch_fsdp2=True), 2)


def test_the_estimate_command_counts_fsdp2_and_its_no_reshard_flag():
    args = ["estimate", *TINY, "--nproc-per-node", "2", "--use-torch-fsdp2", "--num-layers", "8"]
    resharded = invoke(args)
    kept = invoke([*args, "--torch-fsdp2-no-reshard-after-forward"])
    assert resharded.exit_code == 0 and kept.exit_code == 0, resharded.output + kept.output
    assert "fsdp2: parameters, gradients and optimizer state sharded" in resharded.output
    assert resharded.output != kept.output  # the whole chunk stays gathered


def test_a_wrapper_that_returns_something_else_is_named():
    config = tiny_config()
    with pytest.raises(PluginError, match="lacks .*no_sync.* of plugtron.api.DataParallelChunk"):
        checked_chunk(torch.nn.Linear(2, 2), config)


def test_units_are_layers_and_whole_expert_blocks():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.local = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            for p in self.parameters():
                p.allreduce = False

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(2, 2)
            self.experts = Experts()

    model = torch.nn.Module()
    model.embedding = torch.nn.Embedding(4, 2)
    model.layers = torch.nn.ModuleDict({"0": Layer(), "1": torch.nn.Linear(2, 2)})
    units = fsdp2.wrapping_units(model)
    assert units == [model.layers["0"].experts, model.layers["0"], model.layers["1"]]


def test_hook_optimizer_takes_dtensor_params():
    from plugtron.core.plugins.manager import takes_dtensor_params
    assert takes_dtensor_params(tiny_config(optimizer="adam"))
    assert takes_dtensor_params(tiny_config(optimizer="sgd"))
    assert not takes_dtensor_params(tiny_config(optimizer="distributed-adam"))


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_hook_wrap_model_chunk(wrapper):
    # The wrapper keeps the dtype it wants: ddp the training dtype, fsdp2 fp32 shards (it
    # needs a process group, so here only ddp builds; fsdp2 runs in tests/distributed).
    from plugtron.core.contracts.data_parallel import DataParallelChunk
    from plugtron.core.parallel.distributed import single_process
    from plugtron.core.training.loop import setup
    if wrapper == "fsdp2":
        with pytest.raises(ConfigError, match="on one rank shards nothing"):
            setup(tiny_config(use_torch_fsdp2=True), world=single_process())
        return
    run = setup(tiny_config(bf16=True), world=single_process())
    chunk = run.model_chunks[0]
    assert isinstance(chunk, DataParallelChunk) and chunk.grad_shard_groups == ((), ())
    assert {p.dtype for p in chunk.module.parameters()} == {torch.bfloat16}


def test_hook_data_parallel_memory():
    from plugtron.core.plugins.manager import data_parallel_memory
    meta = torch.nn.Linear(64, 64, device="meta")
    config = tiny_config(use_torch_fsdp2=True)
    counted = data_parallel_memory(config, chunks=[meta], dp_cp=4, edp=4, state_per_param=2,
                                   state_values=lambda q: 2, shard_gradients=False)
    numel = 64 * 64 + 64
    assert counted.param_bytes == 4 * (-(-numel // 4)) and counted.grad_bytes == counted.param_bytes
    assert counted.optimizer_bytes == 2 * counted.param_bytes
    whole = data_parallel_memory(tiny_config(), chunks=[meta], dp_cp=4, edp=4,
                                 state_per_param=2, state_values=lambda q: 2,
                                 shard_gradients=False)
    assert (whole.param_bytes, whole.optimizer_bytes, whole.gathered_bytes) == (
        4 * numel, 8 * numel, 0)
    # an optimizer that keeps one value for the matrix and two for the bias (Muon and AdamW)
    for cfg, dp_cp in ((config, 4), (tiny_config(), 1)):
        mixed = data_parallel_memory(cfg, chunks=[meta], dp_cp=dp_cp, edp=dp_cp,
                                     state_per_param=2, shard_gradients=False,
                                     state_values=lambda q: 1 if q.ndim == 2 else 2)
        assert mixed.optimizer_bytes == 4 * (64 * 64 + 2 * 64) // dp_cp


def test_the_estimate_counts_fsdp2_shards_and_gathered_units():
    flags = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4}
    ddp = estimate_memory(tiny_config(**flags, use_distributed_optimizer=True), 4).peak
    fsdp = estimate_memory(tiny_config(**flags, use_torch_fsdp2=True), 4).peak
    assert fsdp.param_bytes * 4 >= ddp.param_bytes >= fsdp.param_bytes * 4 * 0.98
    assert fsdp.grad_bytes < ddp.grad_bytes / 3.9
    assert fsdp.optimizer_selected <= ddp.optimizer_selected * 1.02
    assert fsdp.gathered_bytes > 0 and ddp.gathered_bytes == 0
    assert fsdp.total < ddp.total
