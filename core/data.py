"""From a map-style dataset to this rank's microbatches (Megatron's pretraining sampler).

The dataset is read in order. Each global step of ``micro_batch_size * dp_size`` consecutive
samples is shared out in rank order: data-parallel rank ``r`` takes the ``r``-th block of
``micro_batch_size``. Every rank computes its indices alone, and resuming from
``consumed_samples`` continues exactly where a run stopped, whatever the dp size was before,
because the position depends only on how many samples were consumed in total. Shuffling is the
dataset's job (its epochs are shuffled), which keeps this side free of random state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack samples (dicts of equal-shaped tensors) into one batch: each key becomes ``[n, ...]``."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def microbatch_iterator(dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                        consumed_samples: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches, starting after ``consumed_samples`` samples.

    Walks ``dataset`` in chunks of ``micro_batch_size * dp_size`` consecutive indices from
    ``consumed_samples``; rank ``dp_rank`` gets indices
    ``[chunk_start + dp_rank * micro_batch_size, chunk_start + (dp_rank + 1) * micro_batch_size)``
    as one collated batch. A last chunk that the dataset cannot fill is dropped, so all ranks stop
    together. The arguments are checked now, not at the first ``next()``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must not be negative, got {consumed_samples}")
    return _microbatches(dataset, micro_batch_size, dp_rank, dp_size, consumed_samples)


def _microbatches(dataset, micro_batch_size, dp_rank, dp_size, consumed_samples):
    chunk = micro_batch_size * dp_size
    total = len(dataset)
    chunk_start = consumed_samples
    while chunk_start + chunk <= total:
        first = chunk_start + dp_rank * micro_batch_size
        yield collate([dataset[i] for i in range(first, first + micro_batch_size)])
        chunk_start += chunk
