"""Megatron-Core's GPTDataset and BlendedDataset index algorithms, in numpy.

Same inputs, same arrays, bit for bit, as ``megatron/core/datasets/gpt_dataset.py``,
``blended_dataset.py`` and ``helpers.cpp`` (``build_sample_idx``, ``build_blending_indices``):

* **split** (``--split 969,30,1``): weights normalised, cumulated into book-ends; split j owns
  sequences ``round(b_j N)`` to ``round(b_{j+1} N)`` (Python's round, as Megatron).
* **epochs**: the fewest whose tokens cover ``num_samples x seq + 1``.
* **document index**: the split's sequences repeated once per epoch and shuffled with one
  ``numpy.random.RandomState(seed)``; when the last epoch is needed for fewer than 80% of its
  samples, the first ``epochs - 1`` are shuffled together and the last on its own.
* **sample index**: ``(position in the document index, offset)`` where each sample starts.
  Samples are ``seq + 1`` tokens and the next starts on the previous one's last token, so
  sample j starts at token ``j x seq`` of the document index's concatenated tokens: one
  ``searchsorted`` instead of C++'s walk, and the same numbers.
* **shuffle index**: a permutation of the samples, drawn from the same RandomState after the
  document index (the separate final epoch again shuffled on its own).
* **blending**: sample s goes to the dataset with the largest ``w_i x max(s, 1) - count_i``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re

import numpy as np
import numpy.random  # noqa: F401 - numpy 2 loads it lazily (~14 ms): pay at import, not per build

#: Megatron's threshold for shuffling the last epoch on its own.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
#: Megatron's default mid_level_dataset_surplus: each blended dataset builds 0.5% extra.
BLEND_SURPLUS = 0.005
SPLIT_NAMES = ("train", "valid", "test")


def normalize(weights) -> list[float]:
    """Megatron's ``normalize``: float64 division by the float64 sum."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_bookends(split: str) -> list[tuple[float, float] | None]:
    """``--split`` as Megatron's split matrix: ``(begin, end)`` fractions, ``None`` for an empty
    split (``parse_and_normalize_split`` + ``convert_split_vector_to_split_matrix``)."""
    weights = list(map(float, re.findall(r"[.0-9]+", str(split))))
    weights += [0.0] * (3 - len(weights))
    if len(weights) != 3 or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} must be up to three non-negative weights")
    vector = normalize(weights)
    bounds = [0.0]
    for weight in vector:
        bounds.append(bounds[-1] + weight)
    return [(a, b) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]


def split_range(num_sequences: int, bookend: tuple[float, float]) -> tuple[int, int]:
    return (int(round(bookend[0] * float(num_sequences))),
            int(round(bookend[1] * float(num_sequences))))


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    if num_samples is None or tokens_per_epoch <= 0:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(num_epochs: int, tokens_per_epoch: int, num_samples: int,
                         seq_length: int) -> tuple[bool, int]:
    """Whether the last epoch is shuffled apart, and the samples before it."""
    if num_epochs == 1:
        return False, 0
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_last < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before_last


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    if not separate_final or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """``[num_samples + 1, 2]`` of (document-index position, offset): Megatron's
    ``build_sample_idx`` with ``drop_last_partial_sequence`` and one extra token."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    limit = max(len(document_index), int(np.max(sizes)) if len(sizes) else 0)
    dtype = np.int32 if limit <= np.iinfo(np.int32).max else np.int64
    helpers = _helpers()
    if helpers is not None:
        sizes32 = np.ascontiguousarray(sizes, dtype=np.int32)
        documents32 = np.ascontiguousarray(document_index, dtype=np.int32)
        index = np.empty((num_samples + 1, 2), dtype=np.int64)
        helpers.build_sample_index(sizes32.ctypes.data, documents32.ctypes.data,
                                   len(documents32), seq_length, num_samples, index.ctypes.data)
        return index if dtype == np.int64 else index.astype(dtype)
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    index = np.empty((num_samples + 1, 2), dtype=dtype)
    index[:, 0], index[:, 1] = position, offset
    index[0] = 0  # C++ starts at (0, 0) even when the first document is empty
    return index


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int,
                      num_samples: int | None, seed: int):
    """(document index, sample index, shuffle index) exactly as Megatron-Core's GPTDataset
    builds them for these sequence lengths, split documents, sizes and seed."""
    if seq_length < 2:
        raise ValueError("Megatron's sample index needs --seq-length of at least 2")
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    if tokens_per_epoch <= 1:
        raise ValueError("the split has fewer than two tokens")
    epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate, before_last = separate_final_epoch(epochs, tokens_per_epoch, num_samples or 0,
                                                 seq_length)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length, epochs,
                                      tokens_per_epoch)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before_last if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


# --------------------------------------------------------------------------- blending


def blend_sizes(weights: list[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples asked of each dataset: ``ceil(ceil(size x w_i) x (1 + surplus))``."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index int16, sample index within that dataset int64) of the greedy rule: the
    compiled loop (index_helpers.c) when ``make install`` built it, else the same in Python."""
    weights = [float(w) for w in weights]
    helpers = _helpers()
    if helpers is not None:
        return compiled_blend(helpers, weights, size)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * len(weights)
    pairs = list(enumerate(weights))
    for s in range(size):
        scale = float(max(s, 1))
        best, best_error = 0, weights[0] * scale - counts[0]
        for i, w in pairs[1:]:
            error = w * scale - counts[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[s] = best
        sample_index[s] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


def compiled_blend(helpers, weights: list[float], size: int, general: bool = False):
    """The compiled blend; ``general`` forces its any-number-of-datasets loop instead of the
    register loop it uses for 2-8 datasets (the tests compare the two). The outputs are left
    uninitialised: the loop writes every element once, in order."""
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    w = np.ascontiguousarray(weights, dtype=np.float64)
    counts = np.empty(len(weights), dtype=np.int64)
    helpers.build_blending_indices(dataset_index.ctypes.data, sample_index.ctypes.data,
                                   w.ctypes.data, len(weights), size, counts.ctypes.data,
                                   int(general))
    return dataset_index, sample_index


#: index_helpers.so beside this file (``make install`` compiles index_helpers.c); set
#: PLUGTRON_NO_INDEX_HELPERS=1 to use numpy/Python only.
INDEX_HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "index_helpers.so")


@functools.lru_cache(maxsize=1)
def _helpers():
    if os.environ.get("PLUGTRON_NO_INDEX_HELPERS") or not os.path.exists(INDEX_HELPERS):
        return None
    try:
        library = ctypes.CDLL(INDEX_HELPERS)
    except OSError:
        return None
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    library.build_blending_indices.restype = None
    library.build_blending_indices.argtypes = [pointer, pointer, pointer, i32, i64, pointer,
                                                   i32]
    library.build_sample_index.restype = None
    library.build_sample_index.argtypes = [pointer, pointer, i64, i64, i64, pointer]
    return library
