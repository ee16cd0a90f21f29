"""Megatron-Core's GPTDataset and BlendedDataset over memory-mapped corpora and indices.

gpt_indices.py computes the arrays; index_cache.py keeps them on disk; this module puts them
together into map-style datasets whose sample ``i`` is Megatron-Core's sample ``i``.
"""

from __future__ import annotations

import os

import numpy as np
from plugtron.api import ConfigError, sample_from_window

from . import gpt_indices, index_cache
from .indexed_format import IndexedCorpus, bin_path, idx_path

GPT_ARRAYS = ("document_index", "sample_index", "shuffle_index")
BLEND_ARRAYS = ("dataset_index", "dataset_sample_index")


def corpus_identity(prefix: str) -> dict:
    """What names one corpus in a cache key: its path, and its files' sizes and times, so a
    rewritten corpus never reuses the indices of the old one."""
    idx, bin_ = os.stat(idx_path(prefix)), os.stat(bin_path(prefix))
    return {"prefix": os.path.abspath(prefix), "idx_bytes": idx.st_size,
            "bin_bytes": bin_.st_size, "idx_mtime_ns": idx.st_mtime_ns,
            "bin_mtime_ns": bin_.st_mtime_ns}


class Tokens:
    """What a sample needs from the tokenizer: eod, pad (Megatron's rule: a pad id that is also
    a special token does not count) and the vocabulary (to catch a corpus of another one)."""

    def __init__(self, tokenizer):
        self.eod = tokenizer.eod
        self.vocab_size = tokenizer.vocab_size
        pad = getattr(tokenizer, "pad", None)
        specials = {getattr(tokenizer, name, None) for name in ("eod", "eos", "bos")}
        self.pad = pad if pad is not None and pad not in specials else None


class GPTIndexedDataset:
    """One split of one corpus, in Megatron's sample order. ``len`` is every sample of the epochs
    built (as in Megatron), at least the ``num_samples`` asked for."""

    def __init__(self, corpus: IndexedCorpus, arrays: dict, split: str, tokens: Tokens,
                 options=None, description: dict | None = None):
        self.corpus = corpus
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self.split = split
        self.tokens = tokens
        self.options = options
        self.description = description or {}

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    @property
    def num_epochs(self) -> int:
        documents = self.description.get("range", [0, 0])
        return len(self.document_index) // max(1, documents[1] - documents[0])

    def window(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``index`` (Megatron's
        ``_query_document_sample_shuffle_indices``)."""
        i = int(self.shuffle_index[index])
        first, first_offset = (int(v) for v in self.sample_index[i])
        last, last_offset = (int(v) for v in self.sample_index[i + 1])
        get, documents = self.corpus.get, self.document_index
        if first == last:
            return get(int(documents[first]), first_offset, last_offset - first_offset + 1)
        parts = [get(int(documents[first]), first_offset)]
        parts += [get(int(documents[p])) for p in range(first + 1, last)]
        parts.append(get(int(documents[last]), 0, last_offset + 1))
        return np.concatenate(parts)

    def __getitem__(self, index: int):
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)}")
        window = self.window(index)
        if len(window) and int(window.max()) >= self.tokens.vocab_size:
            raise ConfigError(f"{self.corpus.prefix} holds token id {int(window.max())}, "
                              f"outside the tokenizer's vocabulary of {self.tokens.vocab_size}: "
                              f"was it preprocessed with another tokenizer?")
        return sample_from_window(window, self.options, self.tokens.eod, self.tokens.pad)


class BlendedIndexedDataset:
    """Several datasets of one split mixed by Megatron's greedy rule."""

    def __init__(self, datasets: list, arrays: dict, weights: list[float]):
        self.datasets = datasets
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self.weights = weights

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, index: int):
        return self.datasets[int(self.dataset_index[index])][
            int(self.dataset_sample_index[index])]


# --------------------------------------------------------------------------- building


def build_gpt_split(corpus: IndexedCorpus, bookend, split: str, num_samples: int | None,
                    seq_length: int, seed: int, cache_dir: str | None, tokens: Tokens,
                    options=None, log=None) -> GPTIndexedDataset | None:
    """Megatron's GPTDataset for the sequences that ``bookend`` gives ``split``."""
    if bookend is None:
        return None
    begin, end = gpt_indices.split_range(len(corpus), bookend)
    if end <= begin:
        return None
    description = {"class": "GPTDataset", "corpus": corpus_identity(corpus.prefix),
                   "split": split, "range": [begin, end], "num_samples": num_samples,
                   "seq_length": seq_length, "seed": seed}
    cache_dir = cache_dir or os.path.join(corpus.prefix, "cache", "GPTDataset_indices")

    def build():
        documents = np.arange(begin, end, dtype=np.int32)
        arrays = gpt_indices.build_gpt_indices(np.asarray(corpus.sequence_lengths), documents,
                                               seq_length, num_samples, seed)
        return dict(zip(GPT_ARRAYS, arrays))

    arrays = index_cache.cached(cache_dir, f"GPTDataset-{split}", description, GPT_ARRAYS,
                                build, log)
    return GPTIndexedDataset(corpus, arrays, split, tokens, options, description)


def build_blend(datasets: list, weights: list[float], size: int, cache_dir: str,
                split: str, log=None) -> BlendedIndexedDataset:
    """Megatron's BlendedDataset of ``size`` samples (weights normalised as it does)."""
    weights = gpt_indices.normalize(weights)
    description = {"class": "BlendedDataset", "split": split, "weights": weights,
                   "size": size, "datasets": [d.description for d in datasets]}

    def build():
        dataset_index, sample_index = gpt_indices.build_blending_indices(weights, size)
        counts = np.bincount(dataset_index, minlength=len(datasets))
        for i, (count, dataset) in enumerate(zip(counts, datasets)):
            if count > len(dataset):
                raise ConfigError(f"the {split} blend asks dataset {i} for {count} samples; it "
                                  f"has {len(dataset)}")
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    arrays = index_cache.cached(cache_dir, f"BlendedDataset-{split}", description,
                                BLEND_ARRAYS, build, log)
    return BlendedIndexedDataset(datasets, arrays, weights)
