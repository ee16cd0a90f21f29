"""From a map-style dataset to this rank's microbatches (Megatron's pretraining sampler).

The dataset is read in order. Each global step of ``micro_batch_size * dp_size`` consecutive
samples is shared out in rank order: data-parallel rank ``r`` takes the ``r``-th block of
``micro_batch_size``. Every rank computes its indices alone, and resuming from
``consumed_samples`` continues exactly where a run stopped, whatever the dp size was before,
because the position depends only on how many samples were consumed in total. Shuffling is the
dataset's job (its epochs are shuffled), which keeps this side free of random state.

With ``num_workers > 0`` background threads read and collate the next microbatches while the
step runs (Megatron's ``--num-workers``). Which samples make a microbatch is decided in the main
thread from ``consumed_samples`` alone and the results are handed back in that order, so the
batches are bitwise those of ``num_workers=0`` and resuming stays exact. Threads, not
processes: a dataset's memory-mapped arrays are shared as they are (nothing is pickled or
forked), and the reading (numpy copies from the page cache) runs outside the GIL.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch


def collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack samples (dicts of equal-shaped tensors) into one batch: each key becomes ``[n, ...]``."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def microbatch_iterator(dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                        consumed_samples: int = 0, num_workers: int = 0,
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches, starting after ``consumed_samples`` samples.

    Walks ``dataset`` in chunks of ``micro_batch_size * dp_size`` consecutive indices from
    ``consumed_samples``; rank ``dp_rank`` gets indices
    ``[chunk_start + dp_rank * micro_batch_size, chunk_start + (dp_rank + 1) * micro_batch_size)``
    as one collated batch. A last chunk that the dataset cannot fill is dropped, so all ranks stop
    together. ``num_workers`` threads prepare up to ``2 * num_workers`` microbatches ahead (0:
    each is read when asked for). The arguments are checked now, not at the first ``next()``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must not be negative, got {consumed_samples}")
    if num_workers < 0:
        raise ValueError(f"num_workers must not be negative, got {num_workers}")
    indices = _microbatch_indices(len(dataset), micro_batch_size, dp_rank, dp_size,
                                  consumed_samples)
    load = _Loader(dataset)
    if num_workers == 0:
        return map(load, indices)
    return _prefetched(load, indices, num_workers)


class _Loader:
    def __init__(self, dataset):
        self.dataset = dataset

    def __call__(self, indices: range) -> dict[str, torch.Tensor]:
        return collate([self.dataset[i] for i in indices])


def _microbatch_indices(total, micro_batch_size, dp_rank, dp_size, consumed_samples):
    chunk = micro_batch_size * dp_size
    chunk_start = consumed_samples
    while chunk_start + chunk <= total:
        first = chunk_start + dp_rank * micro_batch_size
        yield range(first, first + micro_batch_size)
        chunk_start += chunk


def _prefetched(load, indices, num_workers: int):
    """``map(load, indices)`` with ``2 * num_workers`` loads in flight, results in order; an
    error in a load is raised where its batch is drawn."""
    pool = ThreadPoolExecutor(num_workers, thread_name_prefix="plugtron-data")
    pending: collections.deque = collections.deque()
    try:
        for index in indices:
            pending.append(pool.submit(load, index))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # also when the iterator is dropped early (evaluation, the end of a run)
        pool.shutdown(wait=False, cancel_futures=True)


class TimedIterator:
    """An iterator that adds up the seconds its ``next()`` waited (the data time of a step:
    reading and collating when inline, only the wait for the prefetch threads otherwise)."""

    def __init__(self, iterator):
        self._iterator = iter(iterator)
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self.wait_s += time.perf_counter() - start

    def take_wait(self) -> float:
        """The seconds waited since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait
