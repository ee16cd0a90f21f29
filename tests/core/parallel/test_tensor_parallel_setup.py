"""Single-process checks of tensor parallelism: size validation messages, layout-independent
initialisation of the shards, the random-stream tracker and the sharding helpers."""

import pytest
import torch
from plugtron.core.blocks.init import normal_init
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_rng_tracker,
)
from plugtron.core.parallel.sharding import (
    full_named_tensors,
    gather_tensor_parallel,
    shard_of,
    unshard,
)
from plugtron.core.training.validate import validate
from plugtron.plugins.layer_backends.local import LocalBackend

from tests.utils import tiny_config


@pytest.mark.parametrize("overrides,message", [
    ({"tp": 2, "num_attention_heads": 3, "hidden_size": 30},
     "--num-attention-heads 3 is not divisible by --tp 2"),
    ({"tp": 4, "num_attention_heads": 8, "num_query_groups": 2},
     "--num-query-groups 2 is not divisible by --tp 4"),
    ({"tp": 4, "num_attention_heads": 4, "hidden_size": 34, "kv_channels": 8},
     "--hidden-size 34 is not divisible by --tp 4"),
    ({"tp": 4, "ffn_hidden_size": 66}, "--ffn-hidden-size 66 is not divisible by --tp 4"),
    ({"tp": 4, "sequence_parallel": True, "seq_length": 18},
     "--seq-length 18 is not divisible by --tp 4 x --cp 1 = 4, which --sequence-parallel needs"),
    ({"tp": 2, "make_vocab_size_divisible_by": 0},
     "--make-vocab-size-divisible-by must be at least 1"),
    ({"label_smoothing": 1.0}, "--label-smoothing must be in [0, 1)"),
])
def test_bad_sizes_fail_before_launch_with_a_clear_message(overrides, message):
    config = tiny_config(**overrides)
    with pytest.raises(ConfigError) as err:
        validate(config, world_size=4)
    assert message in str(err.value)


def test_backend_checks_sizes_for_in_process_runs():
    """A run that skips the CLI's validate still fails before anything is built: setup runs
    every plugin's checks (the GPT plugin owns the head and group rules)."""
    import torch
    from plugtron.core.parallel.distributed import WorldInfo
    from plugtron.core.training.loop import setup

    config = tiny_config(tp=2, num_attention_heads=4, num_query_groups=1)
    with pytest.raises(ConfigError, match="--num-query-groups 1 is not divisible by --tp 2"):
        setup(config, world=WorldInfo(0, 2, 0, 2, torch.device("cpu")))
    config = tiny_config(tp=2, vocab_size=100, make_vocab_size_divisible_by=1)
    config.model.padded_vocab_size = 101
    parallel = ParallelContext.build(2, 0, tp=2, create_groups=False)
    with pytest.raises(ConfigError, match="padded vocabulary 101 is not divisible by --tp 2"):
        LocalBackend(config, parallel)


def test_sequence_parallel_needs_no_divisible_sequence_at_tp1():
    validate(tiny_config(sequence_parallel=True, seq_length=17, max_position_embeddings=17), 1)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_each_shard_is_the_slice_of_the_tp1_init(rank):
    """Layers ask for the full tensor and keep their slice (groups are not needed to build)."""
    config = tiny_config(tp=3, num_attention_heads=3, hidden_size=24, ffn_hidden_size=48,
                         sequence_parallel=True, seq_length=18)
    parallel = ParallelContext.build(3, rank, tp=3, create_groups=False)
    backend = LocalBackend(config, parallel)
    init = normal_init(0.02, 9, "w")
    fc1 = backend.column_parallel_linear(24, 96, bias=True, init_method=init, partition_chunks=2)
    full = init((96, 24))
    gate, up = full[:48], full[48:]
    assert torch.equal(fc1.weight, torch.cat([gate[16 * rank:16 * rank + 16],
                                              up[16 * rank:16 * rank + 16]]))
    assert (fc1.weight.partition_dim, fc1.weight.partition_chunks) == (0, 2)
    assert fc1.bias.tensor_model_parallel and fc1.bias.shape == (32,)

    fc2 = backend.row_parallel_linear(48, 24, bias=True, init_method=init)
    assert torch.equal(fc2.weight, init((24, 48))[:, 16 * rank:16 * rank + 16])
    assert fc2.weight.partition_dim == 1
    assert fc2.bias.sequence_parallel and not getattr(fc2.bias, "tensor_model_parallel", False)

    emb = backend.vocab_parallel_embedding(120, 24, init_method=init)
    assert torch.equal(emb.weight, init((120, 24))[40 * rank:40 * rank + 40])
    assert (emb.vocab_start, emb.vocab_end) == (40 * rank, 40 * rank + 40)
    norm = backend.norm(24)
    assert all(p.sequence_parallel for p in norm.parameters())


def test_unshard_inverts_shard_of_with_chunks():
    full = torch.arange(48.0).reshape(12, 4)
    for dim, chunks in ((0, 1), (0, 2), (1, 2)):
        shards = [shard_of(full, dim, r, 2, chunks) for r in range(2)]
        assert torch.equal(unshard(shards, dim, chunks), full)


def test_full_named_tensors_without_a_group_are_the_params():
    module = torch.nn.Linear(3, 2)
    full = full_named_tensors(module, None)
    assert set(full) == {"weight", "bias"} and torch.equal(full["weight"], module.weight)
    assert gather_tensor_parallel(module.weight, None) is not None


def test_tracker_fork_leaves_the_default_stream_alone():
    tracker = RNGStatesTracker()
    tracker.add("a", 11)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with tracker.fork("a"):
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)
    torch.manual_seed(11)
    assert torch.equal(inside, torch.rand(4))  # stream "a" started from its own seed


def test_tracker_state_round_trip_for_checkpoints():
    parallel = ParallelContext.build(1, 0)
    tracker = model_parallel_rng_tracker(1234, parallel)
    with tracker.fork():
        torch.rand(5)
    saved = tracker.get_state()
    with tracker.fork():
        first = torch.rand(5)
    restored = model_parallel_rng_tracker(1, parallel)
    restored.set_state(saved)
    with restored.fork(MODEL_PARALLEL_RNG):
        assert torch.equal(torch.rand(5), first)
    assert sorted(saved) == ["expert-parallel-rng", "model-parallel-rng"]


def test_tracker_speaks_megatrons_and_te_names():
    """TE's activation checkpointing calls get_states()/set_states() around a recomputed
    forward: the same streams as get_state()/set_state(); reset() forgets them all."""
    parallel = ParallelContext.build(1, 0)
    tracker = model_parallel_rng_tracker(99, parallel)
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)
    assert sorted(saved) == tracker.names()
    tracker.reset()
    assert tracker.names() == []


def test_tracker_errors():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("b"):
            pass


def test_cli_boolean_flags_take_no_value():
    """``--sequence-parallel`` (a flag without a --no- form) must not swallow the next
    argument."""
    import click
    from click.testing import CliRunner
    from plugtron.cli.options import build_config, config_options

    seen = {}

    @click.command()
    @config_options([])
    def command(**params):
        seen["config"] = build_config(params, None, None)

    result = CliRunner().invoke(command, ["--tp", "2", "--sequence-parallel", "--seq-length",
                                          "32"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert config.parallel.sequence_parallel is True and config.model.seq_length == 32
