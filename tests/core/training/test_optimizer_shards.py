"""The data-parallel wrapper's public interface for sharding optimizers: ``optimizer_shards()``
and its dataclasses describe each rank's shard of the buckets, as views of the real storage."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from plugtron.core.errors import PluginError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.ddp import DistributedDataParallel
from plugtron.core.parallel.grad_buffer import GradBuffer
from plugtron.core.training.optimizer_shards import bucket_shard

from tests.utils import tiny_config

OPTIMIZER_PLUGINS = pathlib.Path(__file__).parents[3] / "plugins" / "optimizers"


def _toy():
    # 0.weight 32, 0.bias 8, 2.weight 128, 2.bias 16, 4.weight 32, 4.bias 2: 218 elements.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _wrap(module, sharded):
    config = tiny_config(ddp_bucket_size=40)
    return DistributedDataParallel(module, config, ParallelContext.build(1, 0), sharded=sharded)


def test_shards_are_views_of_the_gradients_and_parameters():
    module = _toy()
    ddp = _wrap(module, sharded=True)
    shards = ddp.optimizer_shards()
    names = {id(p): n for n, p in module.named_parameters()}
    assert [[m.name for m in b.params] for b in shards] == [
        ["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"]]
    for bucket in shards:
        assert bucket.shard_size == 128 and bucket.param_dtype == torch.float32
        for piece in bucket.shards:  # one rank: its shard is the whole bucket
            assert piece.name == names[id(piece.param)]
            assert piece.param_range == (0, piece.param.numel())
            piece.grad.fill_(3.0)
            piece.data.fill_(7.0)
            assert piece.param.main_grad.eq(3.0).all() and piece.param.eq(7.0).all()


def test_two_ranks_shards_cover_every_element_once():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 60, 200)]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    seen = {name: torch.zeros(p.numel()) for p, name in zip(params, names.values())}
    for rank in (0, 1):
        buffer = GradBuffer(params, torch.float32, None, 2, rank, bucket_size=150, sharded=True)
        buffer.grad_data.copy_(torch.arange(buffer.numel, dtype=torch.float32))
        for bucket in buffer.buckets:
            shard = bucket_shard(bucket, names)
            assert shard.shard_size == bucket.numel // 2
            for piece in shard.shards:
                lo, hi = piece.param_range
                seen[piece.name][lo:hi] += 1
                # The gradient view is this rank's shard at the piece's place in it.
                s_lo, s_hi = piece.shard_range
                first = bucket.start + rank * shard.shard_size
                assert torch.equal(piece.grad, buffer.grad_data[first + s_lo:first + s_hi])
            for member in shard.params:
                lo, hi = member.bucket_range
                assert hi - lo == member.param.numel()
    assert all(bool(count.eq(1).all()) for count in seen.values())


def test_unsharded_buffers_have_no_optimizer_shards():
    with pytest.raises(PluginError, match="optimizer_shards_gradients"):
        _wrap(_toy(), sharded=False).optimizer_shards()


def test_the_distributed_optimizer_uses_only_the_public_interface():
    internals = re.compile(r"\.(grad_buffers|buckets|ranges|param_data|grad_data)\b")
    for path in OPTIMIZER_PLUGINS.glob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            assert not internals.search(code), f"{path.name}:{number} reads DDP internals"


def test_the_layer_wise_estimate_splits_as_the_optimizer_does():
    """``layer_wise_memory`` owns parameters as ``owners_by_size`` does (sizes 64, 48, 32, 8 on
    2 ranks: {64, 8} and {48, 32}), sums each rank's bytes and counts the share's buffers."""
    from plugtron.core.training.optimizer_shards import layer_wise_memory, owners_by_size

    named = [(f"p{i}", torch.empty(n, device="meta")) for i, n in enumerate((8, 64, 32, 48))]
    assert owners_by_size([8, 64, 32, 48], 2) == [0, 0, 1, 1]
    state, gather = layer_wise_memory(named, lambda name, p: 3 * p.numel(), dp_cp=2, edp=2)
    assert state == 3 * 80  # the fuller rank: 48 + 32 elements against 64 + 8
    assert gather == 80 * (2 + 1) * 4  # its padded share and the group's all-gather, fp32
    assert layer_wise_memory(named, lambda name, p: p.numel(), dp_cp=1, edp=1) == (152, 0)
