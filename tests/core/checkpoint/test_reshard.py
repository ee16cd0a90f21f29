"""Resharding math: shards of one layout load into any other (synthetic ranks, one process)."""

from __future__ import annotations

import itertools

import pytest
import torch
from plugtron.core.checkpoint import load_checkpoint
from plugtron.core.checkpoint.pieces import Piece, ShardSpec, fill_shard, region
from plugtron.core.parallel.sharding import shard_of, unshard

from .synthetic import expected_shard, full_tensors, rank_run, save_layout

#: (tp, pp, vp, dp)
LAYOUTS = [(1, 1, None, 1), (2, 2, None, 1), (4, 1, None, 1), (1, 2, 2, 1), (2, 1, None, 2),
           (2, 2, 2, 1)]


@pytest.mark.parametrize("dim,chunks", [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3)])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_boxes_are_the_shard(dim, chunks, size):
    full = torch.arange(24 * 24.0).reshape(24, 24)
    for rank in range(size):
        spec = ShardSpec((24, 24), dim, chunks, rank, size)
        shard = shard_of(full, dim, rank, size, chunks)
        assert spec.local_shape == tuple(shard.shape)
        rebuilt = torch.full(spec.local_shape, -1.0)
        for box in spec.boxes():
            rebuilt[region(box.local_offset, box.shape)] = full[region(box.offset, box.shape)]
        assert torch.equal(rebuilt, shard)
    shards = [shard_of(full, dim, r, size, chunks) for r in range(size)]
    assert torch.equal(unshard(shards, dim, chunks), full)


@pytest.mark.parametrize("save_size,load_size", itertools.product([1, 2, 4], repeat=2))
@pytest.mark.parametrize("dim,chunks", [(0, 1), (1, 1), (0, 2)])
def test_fill_shard_between_sizes(save_size, load_size, dim, chunks):
    full = torch.randn(16, 8 if dim == 0 else 16, generator=torch.Generator().manual_seed(1))
    stored = {}
    pieces = []
    for rank in range(save_size):
        spec = ShardSpec(tuple(full.shape), dim, chunks, rank, save_size)
        for i, box in enumerate(spec.boxes()):
            key = f"r{rank}@{i}"
            stored[key] = full[region(box.offset, box.shape)].clone()
            pieces.append(Piece("f", key, box.offset, box.shape))

    def read(piece, slices):
        return stored[piece.key][slices]

    for rank in range(load_size):
        spec = ShardSpec(tuple(full.shape), dim, chunks, rank, load_size)
        target = torch.zeros(spec.local_shape)
        copied, expected = fill_shard(target, spec, tuple(full.shape), pieces, read)
        assert copied == expected == target.numel()
        assert torch.equal(target, shard_of(full, dim, rank, load_size, chunks))


def test_missing_piece_is_reported():
    full = torch.randn(8, 4)
    spec0 = ShardSpec((8, 4), 0, 1, 0, 2)
    box = spec0.boxes()[0]
    pieces = [Piece("f", "k", box.offset, box.shape)]
    target = torch.zeros(8, 4)
    copied, expected = fill_shard(target, ShardSpec((8, 4)), (8, 4), pieces,
                                  lambda p, s: full[region(box.offset, box.shape)][s])
    assert (copied, expected) == (16, 32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per (layout, tied/untied)."""
    out = {}
    for untied in (False, True):
        full = full_tensors(untied)
        for lay in LAYOUTS:
            tag = "_".join(map(str, lay))
            parent = tmp_path_factory.mktemp(f"ckpt_{'u' if untied else 't'}_{tag}")
            save_layout(str(parent), full, *lay, untied=untied)
            out[(lay, untied)] = (str(parent), full)
    return out


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
@pytest.mark.parametrize("source", LAYOUTS, ids=lambda layout: "tp{}pp{}vp{}dp{}".format(*layout))
def test_any_layout_loads_into_any_other(saved, source, untied):
    parent, full = saved[(source, untied)]
    for target in LAYOUTS:
        tp, pp, vp, dp = target
        for rank in range(tp * pp * dp):
            run = rank_run(full, tp, pp, vp, dp, rank, untied, fill=lambda s: torch.full(s, 7.0))
            load_checkpoint(run, parent)
            assert run.state.iteration == 5 and run.state.consumed_samples == 40
            loaded = run.optimizer.loaded
            assert loaded["__optimizer__"]["step"] == 5.0
            assert torch.equal(loaded["__optimizer__"]["scale"], torch.tensor(2.0))
            for chunk in run.model_chunks:
                for name, param in chunk.state_dict(keep_vars=True).items():
                    want, mask = expected_shard(full, name, run, untied)
                    where = f"{name} on rank {rank} of {target} from {source}"
                    assert torch.equal(param.detach()[mask], want[mask]), where
                    assert torch.equal(loaded[name]["exp_avg"][mask], (want * 2 + 1)[mask]), where
                    assert torch.equal(loaded[name]["exp_avg_sq"][mask], (want ** 2)[mask]), where


def test_dp_replicas_write_nothing_but_rng(saved):
    import json
    import os

    parent, _ = saved[((2, 1, None, 2), False)]
    directory = os.path.join(parent, "iter_0000005")
    files = sorted(os.listdir(directory))
    # dp rank 1 holds ranks 2 and 3 (tp-cp-ep-dp-pp order): manifests only, no tensors
    assert "model_rank_00002.safetensors" not in files
    assert "model_rank_00001.safetensors" in files
    with open(os.path.join(directory, "rank_00002.json")) as f:
        manifest = json.load(f)["content"]
    assert manifest["tensors"] == {} and manifest["rng"] is not None


def test_tied_output_is_stored_once(saved):
    from plugtron.core.checkpoint import CheckpointReader

    reader = CheckpointReader(saved[((2, 2, None, 1), False)][0])
    assert "model/output_layer.weight" not in reader.tensors
    assert reader.tensors["model/embedding.word_embeddings.weight"].global_shape == (112, 16)
    untied = CheckpointReader(saved[((2, 2, None, 1), True)][0])
    assert "model/output_layer.weight" in untied.tensors
