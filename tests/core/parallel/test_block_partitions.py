"""Tensor-parallel blocks of different sizes (Mamba's in_proj [z, x, B, C, dt]): each block is
split over tp on its own, and every reader of the declared sharding agrees."""

from __future__ import annotations

import torch
from plugtron.core.checkpoint.pieces import ShardSpec
from plugtron.core.parallel.sharding import block_sizes, shard_of, unshard

BLOCKS = (8, 8, 4, 4, 2)


def test_shards_hold_each_block_split_separately():
    full = torch.arange(26.0)
    shards = [shard_of(full, 0, r, 2, BLOCKS) for r in range(2)]
    assert shards[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 20, 21, 24]
    assert torch.equal(unshard(shards, 0, BLOCKS), full)


def test_equal_blocks_as_before():
    full = torch.arange(12.0).reshape(12, 1)
    assert block_sizes(12, 2) == [6, 6]
    assert torch.equal(shard_of(full, 0, 1, 2, 2), shard_of(full, 0, 1, 2, (6, 6)))


def test_checkpoint_boxes_cover_the_shard():
    full = torch.arange(26.0 * 3).reshape(26, 3)
    for rank in range(2):
        spec = ShardSpec((26, 3), 0, BLOCKS, rank, 2)
        local = shard_of(full, 0, rank, 2, BLOCKS)
        assert sum(b.shape[0] for b in spec.boxes()) == local.shape[0] == spec.local_shape[0]
        for box in spec.boxes():
            rows = slice(box.offset[0], box.offset[0] + box.shape[0])
            mine = slice(box.local_offset[0], box.local_offset[0] + box.shape[0])
            assert torch.equal(full[rows], local[mine])
