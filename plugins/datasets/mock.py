"""``--data mock``: synthetic documents that a model can learn, with no files needed.

Uniformly random tokens would leave nothing to learn, so a run on them could not show that
training works. The documents here come from a fixed random "grammar" seeded by ``--seed``, half
of each kind:

* arithmetic documents: ``start, start + step, start + 2 step, ...`` modulo the content
  vocabulary; after two tokens the rest is fully predictable.
* Markov documents: each token has ``BRANCHING`` allowed successors drawn once per seed; the
  next token is one of them uniformly, so the best possible loss there is ``log(BRANCHING)``.

Every document is followed by the end-of-document token ``vocab_size - 1``. All splits share the
grammar but draw different documents, so validation loss measures generalisation.

Documents are generated in fixed-size blocks, each from a random stream of its own keyed by
(seed, split, block index), so sample ``i`` depends only on the seed, the vocabulary, the
sequence length, the split and ``i``: not on ``--train-iters`` or any other run length.
"""

from __future__ import annotations

import numpy as np
from plugtron.api import SAMPLE_SECTION, ConfigError, hookimpl, validate_sample_options

from .common import BlockWindowDataset, parse_split, seeded_rng, token_dtype

DEFAULT_VOCAB_SIZE = 512
#: Allowed successors per token in Markov documents.
BRANCHING = 4
MIN_DOCUMENT_LENGTH = 8
MAX_DOCUMENT_LENGTH = 256
MAX_ARITHMETIC_STEP = 16
#: Samples (windows) per block of documents. A block's windows are read in a shuffled order, so
#: a batch mixes documents from all over the block; runs read blocks one after the other. (On
#: the 50-step tiny run, 4096 generalised to held-out documents better than 256 or 65536.)
WINDOWS_PER_BLOCK = 4096
#: Fewer windows per block for long sequences, so that a block stays within 4M tokens (8 MB as
#: uint16; a dataset holds at most two); a block always holds at least one window.
MAX_BLOCK_TOKENS = 1 << 22
#: Documents generated per vectorised batch; bounds the temporary [docs, length] matrix.
DOCUMENTS_PER_BATCH = 4096

# Tags that give each use of the seed its own random stream.
_GRAMMAR_TAG = 101
_DOCUMENTS_TAG = 202


class SyntheticGrammar:
    """The fixed rules behind the mock documents, drawn once from ``seed``."""

    def __init__(self, vocab_size: int, seed: int):
        if vocab_size < 2:
            raise ConfigError(f"--data mock needs --vocab-size of at least 2 (one content token "
                              f"and the end-of-document token), got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.num_content_tokens = vocab_size - 1
        rng = seeded_rng(seed, _GRAMMAR_TAG)
        self.successors = rng.integers(0, self.num_content_tokens,
                                       size=(self.num_content_tokens, BRANCHING))

    def _document_batch(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` documents, each with its EOD, concatenated in order."""
        width = MAX_DOCUMENT_LENGTH
        lengths = rng.integers(MIN_DOCUMENT_LENGTH, width + 1, size=count)
        is_markov = rng.random(count) < 0.5
        tokens = np.empty((count, width + 1), dtype=np.int64)

        starts = rng.integers(0, self.num_content_tokens, size=count)
        steps = rng.integers(1, MAX_ARITHMETIC_STEP + 1, size=count)
        tokens[:, :width] = (starts[:, None] + steps[:, None] * np.arange(width)) \
            % self.num_content_tokens

        markov_rows = np.flatnonzero(is_markov)
        choices = rng.integers(0, BRANCHING, size=(len(markov_rows), width))
        chain = tokens[markov_rows, :width]
        for t in range(1, width):
            chain[:, t] = self.successors[chain[:, t - 1], choices[:, t]]
        tokens[markov_rows, :width] = chain

        tokens[np.arange(count), lengths] = self.eod
        keep = np.arange(width + 1)[None, :] <= lengths[:, None]
        return tokens[keep]  # row-major: document after document

    def stream(self, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """A stream of exactly ``num_tokens`` tokens (the last document may be cut short)."""
        parts, total = [], 0
        mean_document = (MIN_DOCUMENT_LENGTH + MAX_DOCUMENT_LENGTH) / 2 + 1
        while total < num_tokens:
            needed = int((num_tokens - total) / mean_document) + 1
            part = self._document_batch(rng, min(DOCUMENTS_PER_BATCH, needed))
            parts.append(part.astype(token_dtype(self.vocab_size)))
            total += len(part)
        return np.concatenate(parts)[:num_tokens]

    def block_maker(self, seed: int, split_index: int):
        """``make_block(b, num_tokens)`` for one split: block ``b`` from a random stream of its
        own, so that any block can be made without the ones before it."""
        def make_block(index: int, num_tokens: int) -> np.ndarray:
            return self.stream(num_tokens, seeded_rng(seed, _DOCUMENTS_TAG, split_index, index))
        return make_block


def windows_per_block(seq_length: int) -> int:
    return max(1, min(WINDOWS_PER_BLOCK, MAX_BLOCK_TOKENS // max(seq_length, 1)))


class MockDataset:
    """Dataset provider ``mock`` (entry point in ``plugtron.datasets``)."""

    @hookimpl
    def plugtron_validate(self, config):
        validate_sample_options(config)

    @hookimpl
    def plugtron_config_sections(self):
        return [SAMPLE_SECTION]

    @hookimpl
    def dataset_vocab_size(self, config):
        return config.model.vocab_size or DEFAULT_VOCAB_SIZE

    @hookimpl
    def dataset_provider(self, config, split_sizes):
        """Build (train, valid, test) mock datasets; a split asked for 0 samples, or with split
        weight 0, is ``None``. Sets ``config.model.vocab_size`` to 512 when it is unset."""
        if config.model.vocab_size is None:
            config.model.vocab_size = DEFAULT_VOCAB_SIZE
        seq_length = config.model.seq_length
        seed = config.training.seed
        grammar = SyntheticGrammar(config.model.vocab_size, seed)
        weights = parse_split(config.data.split)
        datasets = []
        for split_index, (num_samples, weight) in enumerate(zip(split_sizes, weights)):
            if num_samples <= 0 or weight == 0:
                datasets.append(None)
                continue
            datasets.append(BlockWindowDataset(grammar.block_maker(seed, split_index),
                                               windows_per_block(seq_length), seq_length,
                                               num_samples, seed, split_index,
                                               getattr(config, "samples", None), grammar.eod))
        return tuple(datasets)
