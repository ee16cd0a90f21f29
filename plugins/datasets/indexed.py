"""``--data indexed``: Megatron ``.bin/.idx`` corpora in Megatron-Core's sample order.

``--data-path PREFIX`` (one corpus, split by ``--split``), ``--data-path 0.3 A 0.7 B`` (a blend:
weights and prefixes), or ``--train-data-path / --valid-data-path / --test-data-path`` (a corpus
or blend per split, each used whole). The same corpus, seed, split, sequence length and sizes
give the samples Megatron-Core's GPTDataset and BlendedDataset give, in the same order.

Resuming: the order depends on the sample counts the indices were built for, so the counts are
recorded in the config (``indexed.index_samples``, saved in every checkpoint) and a run that
resumes builds for the first run's counts as long as they cover what it needs; a larger
``--train-iters`` within the epochs already built therefore continues the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from plugtron.api import (
    SAMPLE_SECTION,
    ConfigError,
    ConfigSection,
    build_tokenizer,
    hookimpl,
    opt,
    saved_config,
    tokenizer_for,
    validate_sample_options,
)

from . import gpt_indices
from .gpt_dataset import Tokens, build_blend, build_gpt_split
from .indexed_format import IndexedCorpus, IndexedFormatError
from .preprocess import format_summary, preprocess


@dataclass
class IndexedOptions:
    train_data_path: list = opt([], "--train-data-path",
                                "Corpus or blend (weights and prefixes) for training only.")
    valid_data_path: list = opt([], "--valid-data-path", "Corpus or blend for validation only.")
    test_data_path: list = opt([], "--test-data-path", "Corpus or blend for testing only.")
    data_cache_path: str | None = opt(None, "--data-cache-path",
                                      "Folder for the index files (default: PREFIX/cache/"
                                      "GPTDataset_indices, as Megatron).")
    #: The sample counts (train, valid, test) the indices were built for; set by the provider
    #: and kept in checkpoints so that a resumed run rebuilds the same order.
    index_samples: list | None = None


INDEXED_SECTION = ConfigSection("indexed", IndexedOptions, title="Indexed (Megatron) data")


def parse_blend(values: list) -> tuple[list[str], list[float] | None]:
    """Megatron's ``get_blend_from_list``: ``[w1, p1, w2, p2, ...]`` when every other item is a
    number, else a list of prefixes. A prefix may be given with its ``.bin``/``.idx`` suffix."""
    values = [str(v) for v in values]
    weights = None
    if len(values) % 2 == 0:
        try:
            weights = [float(w) for w in values[0::2]]
            prefixes = values[1::2]
        except ValueError:
            weights = None
    if weights is None:
        prefixes = values
    prefixes = [p[:-4] if p.endswith((".bin", ".idx")) else p for p in prefixes]
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise ConfigError(f"blend weights {weights} must be non-negative and not all zero")
    return prefixes, weights


def open_corpus(prefix: str) -> IndexedCorpus:
    try:
        return IndexedCorpus(prefix)
    except (FileNotFoundError, IndexedFormatError) as exc:
        raise ConfigError(f"--data-path {prefix!r}: {exc}") from None


class IndexedDataset:
    """Dataset provider ``indexed`` (entry point in ``plugtron.datasets``)."""

    #: The last run's tokenizer (``plugtron data inspect`` shows text with it).
    tokenizer = None
    #: ``plugtron data preprocess`` reaches the tools through the entry point.
    preprocess = staticmethod(preprocess)
    format_summary = staticmethod(format_summary)

    @hookimpl
    def plugtron_validate(self, config):
        validate_sample_options(config)

    @hookimpl
    def plugtron_config_sections(self):
        return [SAMPLE_SECTION, INDEXED_SECTION]

    @hookimpl
    def dataset_vocab_size(self, config):
        name = config.data.tokenizer_type  # required: the run refuses indexed data without it
        return build_tokenizer(name, config.data.tokenizer_model, None).vocab_size if name \
            else None

    @hookimpl
    def dataset_provider(self, config, split_sizes):
        """Build (train, valid, test); a split asked for 0 samples or given no documents is
        ``None``. The tokenizer (``--tokenizer-type``, required) fixes the vocabulary."""
        tokenizer = self.tokenizer = tokenizer_for(config)
        sizes = self.index_sizes(config, split_sizes)
        datasets = self.build(config, sizes, Tokens(tokenizer))
        if sizes != list(split_sizes) and any(
                d is not None and len(d) < n for d, n in zip(datasets, split_sizes)):
            # The first run's indices do not reach this far: build for what is asked now. The
            # order goes on unchanged while every corpus keeps its epochs (a blend's greedy
            # index only grows at its end); say which it is.
            before = datasets
            sizes = list(split_sizes)
            datasets = self.build(config, sizes, Tokens(tokenizer))
            if all(_continues(a, b) for a, b in zip(before, datasets)):
                _log(config, "the run needs more samples than the indices of the run it resumes "
                             "hold; built them for this run; the sample order continues "
                             "(the same epochs)")
            else:
                _log(config, "the run needs more epochs than the run it resumes; built new "
                             "indices (the sample order from here differs from the first run's)")
        config.indexed.index_samples = sizes
        return tuple(datasets)

    @staticmethod
    def index_sizes(config, split_sizes) -> list[int]:
        saved = saved_config(config.checkpoint.load)
        recorded = ((saved or {}).get("indexed") or {}).get("index_samples")
        if recorded and len(recorded) == 3:
            return [int(n) for n in recorded]
        return [int(n) for n in split_sizes]

    def build(self, config, sizes: list[int], tokens: Tokens) -> list:
        options = getattr(config, "samples", None)
        opts = config.indexed
        seq, seed = config.model.seq_length, config.training.seed
        per_split = [opts.train_data_path, opts.valid_data_path, opts.test_data_path]

        def log(message):
            _log(config, message)

        def dataset(prefix, bookend, split, num_samples):
            corpus = open_corpus(prefix)
            return build_gpt_split(corpus, bookend, split, num_samples, seq, seed,
                                   opts.data_cache_path, tokens, options, log)

        def blend(values, bookends, split_index):
            split = gpt_indices.SPLIT_NAMES[split_index]
            size = sizes[split_index]
            if bookends[split_index] is None:  # a split of weight 0
                return None
            prefixes, weights = parse_blend(values)
            if len(prefixes) == 1:
                return dataset(prefixes[0], bookends[split_index], split, size)
            if weights is None:  # one epoch of each, weighted by its size (Megatron's rule)
                parts = [dataset(p, bookends[split_index], split, None) for p in prefixes]
                weights = [len(p) for p in parts]
                size = min(size, sum(weights))
            else:
                weights = gpt_indices.normalize(weights)
                wanted = gpt_indices.blend_sizes(weights, size, gpt_indices.BLEND_SURPLUS)
                parts = [dataset(p, bookends[split_index], split, n)
                         for p, n in zip(prefixes, wanted)]
                size = sum(gpt_indices.blend_sizes(weights, size))
            if any(p is None for p in parts):
                raise ConfigError(f"a corpus of the {split} blend has no documents in that split")
            cache = opts.data_cache_path or os.path.join(parts[0].corpus.prefix, "cache",
                                                         "GPTDataset_indices")
            return build_blend(parts, weights, size, cache, split, log)

        if any(per_split):
            if config.data.data_path:
                raise ConfigError("give either --data-path or --train-data-path/"
                                  "--valid-data-path/--test-data-path, not both")
            out = []
            for i, values in enumerate(per_split):
                bookends: list[tuple[float, float] | None] = [None, None, None]
                bookends[i] = (0.0, 1.0)
                out.append(blend(values, bookends, i) if values and sizes[i] > 0 else None)
            return out
        if not config.data.data_path:
            raise ConfigError("--data indexed needs --data-path PREFIX (a Megatron .bin/.idx "
                              "pair, e.g. from `plugtron data preprocess`) or "
                              "--train-data-path")
        try:
            bookends = gpt_indices.split_bookends(config.data.split)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return [blend(config.data.data_path, bookends, i) if sizes[i] > 0 else None
                for i in range(3)]


def _continues(old, new) -> bool:
    """Whether ``new`` gives ``old``'s samples at ``old``'s indices (then a resumed run goes on
    in the same order): a GPT split's three indices equal (the same epochs, the same final-epoch
    rule), a blend's indices a prefix of the new ones over parts that continue."""

    if old is None or new is None:
        return old is new
    if hasattr(old, "dataset_index"):
        n = len(old)
        return (hasattr(new, "dataset_index") and len(new) >= n
                and np.array_equal(old.dataset_index, new.dataset_index[:n])
                and np.array_equal(old.dataset_sample_index, new.dataset_sample_index[:n])
                and len(old.datasets) == len(new.datasets)
                and all(_continues(a, b) for a, b in zip(old.datasets, new.datasets)))
    return all(np.array_equal(getattr(old, name), getattr(new, name))
               for name in ("document_index", "sample_index", "shuffle_index"))


def _log(config, message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"data: {message}", flush=True)
