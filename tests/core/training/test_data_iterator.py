"""Microbatch iterators: Megatron's pretraining-sampler order across dp ranks and on resume."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from plugtron.core.config import TrainConfig
from plugtron.core.training.data import collate, microbatch_iterator
from plugtron.plugins.datasets.mock import MockDataset

SEQ = 4


class IndexDataset:
    """Sample ``i`` carries ``i`` in every token, so a batch shows which indices it holds."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return {"tokens": torch.full((SEQ,), index, dtype=torch.int64),
                "loss_mask": torch.ones(SEQ)}


def indices(batch):
    return batch["tokens"][:, 0].tolist()


def test_two_dp_ranks_share_out_what_one_rank_reads():
    dataset = IndexDataset(64)
    mbs, global_batch = 2, 8
    one_rank = [indices(b) for b in microbatch_iterator(dataset, mbs, 0, 1)]
    rank0 = [indices(b) for b in microbatch_iterator(dataset, mbs, 0, 2)]
    rank1 = [indices(b) for b in microbatch_iterator(dataset, mbs, 1, 2)]
    assert rank0[:2] == [[0, 1], [4, 5]] and rank1[:2] == [[2, 3], [6, 7]]
    per_rank = global_batch // (mbs * 2)
    for step in range(len(dataset) // global_batch):
        dp1 = one_rank[step * 4:(step + 1) * 4]
        dp2 = rank0[step * per_rank:(step + 1) * per_rank] + \
            rank1[step * per_rank:(step + 1) * per_rank]
        assert sorted(chain(*dp2)) == sorted(chain(*dp1)) == \
            list(range(step * global_batch, (step + 1) * global_batch))


def test_consumed_samples_resumes_where_it_left_off():
    dataset = IndexDataset(50)
    uninterrupted = microbatch_iterator(dataset, 3, 1, 2)
    first = [indices(next(uninterrupted)) for _ in range(3)]
    consumed = 3 * 3 * 2  # three steps of micro_batch_size * dp_size
    resumed = [indices(b) for b in microbatch_iterator(dataset, 3, 1, 2, consumed)]
    assert resumed == [indices(b) for b in uninterrupted]
    assert first[-1] == [15, 16, 17] and resumed[0] == [21, 22, 23]
    # A resume with another dp size continues from the same sample.
    assert indices(next(microbatch_iterator(dataset, 3, 0, 1, consumed))) == [18, 19, 20]


def test_stops_when_the_dataset_cannot_fill_a_step():
    batches = list(microbatch_iterator(IndexDataset(10), 2, 1, 2))
    assert [indices(b) for b in batches] == [[2, 3], [6, 7]]  # samples 8, 9 are dropped
    assert list(microbatch_iterator(IndexDataset(10), 2, 0, 2, consumed_samples=8)) == []


def test_bad_arguments_fail_at_the_call():
    for kwargs in ({"micro_batch_size": 0, "dp_rank": 0, "dp_size": 1},
                   {"micro_batch_size": 1, "dp_rank": 2, "dp_size": 2},
                   {"micro_batch_size": 1, "dp_rank": 0, "dp_size": 1, "consumed_samples": -1}):
        with pytest.raises(ValueError):
            microbatch_iterator(IndexDataset(4), **kwargs)


def test_collate_stacks_real_samples():
    config = TrainConfig()
    config.model.seq_length = 8
    train, _, _ = MockDataset().dataset_provider(config, (8, 0, 0))
    batch = next(microbatch_iterator(train, 4, 0, 2))
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "tokens": (4, 8), "labels": (4, 8), "loss_mask": (4, 8), "position_ids": (4, 8)}
    assert torch.equal(batch["tokens"][2], train[2]["tokens"])
    assert collate([train[0]])["tokens"].shape == (1, 8)


def test_prefetch_threads_give_the_inline_batches_in_order():
    dataset = IndexDataset(40)
    inline = [indices(b) for b in microbatch_iterator(dataset, 2, 1, 2, consumed_samples=4)]
    for workers in (1, 3):
        got = [indices(b) for b in microbatch_iterator(dataset, 2, 1, 2, consumed_samples=4,
                                                       num_workers=workers)]
        assert got == inline
    with pytest.raises(ValueError, match="num_workers"):
        microbatch_iterator(dataset, 2, 0, 1, num_workers=-1)


class FailingDataset(IndexDataset):
    def __getitem__(self, index):
        if index == 5:
            raise KeyError("sample 5 is broken")
        return super().__getitem__(index)


def test_a_failing_sample_raises_where_its_batch_is_drawn():
    batches = microbatch_iterator(FailingDataset(16), 2, 0, 1, num_workers=2)
    assert indices(next(batches)) == [0, 1] and indices(next(batches)) == [2, 3]
    with pytest.raises(KeyError, match="sample 5"):
        next(batches)


def test_prefetch_threads_share_a_mock_dataset_safely():
    """The mock/text datasets cache blocks and epoch orders; threads read them concurrently."""
    from tests.utils import tiny_config

    config = tiny_config(seq_length=8)
    train = MockDataset().dataset_provider(config=config, split_sizes=(64, 0, 0))[0]
    inline = [b["tokens"] for b in microbatch_iterator(train, 2, 0, 1)]
    threaded = [b["tokens"] for b in microbatch_iterator(train, 2, 0, 1, num_workers=3)]
    assert len(inline) == len(threaded) > 0
    assert all(torch.equal(a, b) for a, b in zip(inline, threaded))
