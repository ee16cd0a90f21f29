"""What the built-in dataset providers share: the split-by-weights rule and the windowed datasets.

A provider turns its source into one token stream per split, with an end-of-document token after
each document, and cuts it into samples of ``seq_length + 1`` tokens: a finite source (text
files) hands its stream to :class:`TokenWindowDataset`; an unbounded one (synthetic documents)
produces it in fixed-size blocks for :class:`BlockWindowDataset`. Keeping both here means every
provider produces samples with exactly the same layout.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from plugtron.api import ConfigError, build_tokenizer, sample_from_window


def seeded_rng(seed: int, *tags: int) -> np.random.Generator:
    """A numpy generator for ``(seed, *tags)``: one independent stream per purpose and split.

    ``SeedSequence`` wants non-negative integers, so a negative user seed is mapped onto 64 bits.
    """
    return np.random.default_rng([int(seed) & (2**64 - 1), *tags])


def tokenizer_vocab_size(config, default_tokenizer: str) -> int:
    """The vocabulary of the run's tokenizer (``--tokenizer-type``, else ``default_tokenizer``),
    known before any data is read: the datasets' ``dataset_vocab_size``."""
    name = config.data.tokenizer_type or default_tokenizer
    return build_tokenizer(name, config.data.tokenizer_model, None).vocab_size


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id, to keep streams small in memory."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


# --------------------------------------------------------------------------- splits


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` ("969,30,1" or "98/2/0") as normalised (train, valid, test) weights.

    Fewer than three weights are padded with zeros, as in Megatron.
    """
    text = str(split).replace("/", ",")
    try:
        weights = [float(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise ConfigError(f"--split {split!r} must be up to three comma-separated numbers, "
                          f"e.g. 969,30,1") from None
    if not weights or len(weights) > 3:
        raise ConfigError(f"--split {split!r} must be one to three comma-separated numbers, "
                          f"e.g. 969,30,1")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) == 0:
        raise ConfigError(f"--split {split!r}: weights must be finite, non-negative and not all "
                          f"zero")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def split_counts(num_items: int, weights: Sequence[float]) -> list[int]:
    """How many of ``num_items`` documents each split gets.

    Largest-remainder rounding, so the counts always add up to ``num_items``. Then every split
    with a positive weight that rounded to nothing takes one document from the largest split,
    provided there are enough documents for each such split to have one: a 969,30,1 split of a
    small corpus still gets a validation and a test document.
    """
    exact = [w * num_items for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: num_items - sum(counts)]:
        counts[i] += 1
    wanted = [i for i, w in enumerate(weights) if w > 0]
    if num_items >= len(wanted):
        for i in wanted:
            if counts[i] == 0:
                donor = max(range(len(counts)), key=lambda j: (counts[j], -j))
                counts[donor] -= 1
                counts[i] += 1
    return counts


def split_documents(num_documents: int, weights: Sequence[float],
                    rng: np.random.Generator) -> list[np.ndarray]:
    """Document indices of each split: shuffle once, then cut into contiguous slices.

    Shuffling first keeps a corpus that is sorted by topic (a folder per subject) from putting a
    whole topic in the test split; slicing keeps every document in exactly one split.
    """
    order = rng.permutation(num_documents)
    bounds = np.cumsum([0, *split_counts(num_documents, weights)])
    return [order[bounds[i]:bounds[i + 1]] for i in range(len(weights))]


def concat_documents(documents: Sequence[np.ndarray], eod: int, dtype: np.dtype) -> np.ndarray:
    """One stream: each document followed by ``eod``, written once into a preallocated array."""
    stream = np.empty(sum(len(d) for d in documents) + len(documents), dtype=dtype)
    position = 0
    for document in documents:
        stream[position:position + len(document)] = document
        position += len(document)
        stream[position] = eod
        position += 1
    return stream


# --------------------------------------------------------------------------- samples


def make_sample(window: np.ndarray, options=None, eod: int | None = None) -> dict[str, torch.Tensor]:
    """A sample from ``seq_length + 1`` consecutive tokens (sample_options.py applies
    ``--reset-position-ids``, ``--reset-attention-mask`` and ``--eod-mask-loss``)."""
    return sample_from_window(window, options, eod)


class TokenWindowDataset:
    """Map-style dataset of ``seq_length + 1``-token windows over one token stream.

    One epoch is the ``n = (len(stream) - 1) // seq_length`` non-overlapping windows (window ``w``
    starts at ``w * seq_length``; consecutive windows share one token so every token is a label
    once). Epoch ``e`` visits them in a permutation seeded by ``(seed, split_index, e)``, so
    sample ``i`` is window ``perm_e[i % n]`` with ``e = i // n``, which any rank can compute alone.
    The length is a whole number of epochs that covers ``num_samples``: asking for more samples
    than the stream holds wraps into further, differently shuffled epochs.

    A stream shorter than one window is repeated until it fills one, so a split with a single
    short document still yields a sample. The stream stays in its compact dtype; tensors are
    built per sample in ``__getitem__``.
    """

    def __init__(self, stream: np.ndarray, seq_length: int, num_samples: int, seed: int,
                 split_index: int, options=None, eod: int | None = None):
        if seq_length < 1:
            raise ConfigError(f"--seq-length must be at least 1, got {seq_length}")
        if len(stream) == 0:
            raise ValueError("a TokenWindowDataset needs a non-empty token stream")
        if len(stream) < seq_length + 1:
            stream = np.tile(stream, math.ceil((seq_length + 1) / len(stream)))
        self.stream = stream
        self.seq_length = seq_length
        self.seed = seed
        self.split_index = split_index
        self.options, self.eod = options, eod
        self.windows_per_epoch = (len(stream) - 1) // seq_length
        self.num_epochs = max(1, math.ceil(num_samples / self.windows_per_epoch))
        # (epoch, permutation) as one value: --num-workers threads read it concurrently
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.stream)

    def __len__(self) -> int:
        return self.num_epochs * self.windows_per_epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        # Samples are read in order, so caching the current epoch's permutation is enough.
        cached = self._cached
        if cached is None or cached[0] != epoch:
            rng = seeded_rng(self.seed, self.split_index, epoch)
            cached = self._cached = (epoch, rng.permutation(self.windows_per_epoch))
        return cached[1]

    def window_start(self, index: int) -> int:
        """Offset into the stream of sample ``index``'s first token."""
        epoch, position = divmod(index, self.windows_per_epoch)
        return int(self._epoch_order(epoch)[position]) * self.seq_length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)}")
        start = self.window_start(index)
        return make_sample(self.stream[start:start + self.seq_length + 1], self.options, self.eod)


#: Tag of the within-block window order's random stream (see :func:`seeded_rng`).
_BLOCK_ORDER_TAG = 404


class BlockWindowDataset:
    """Map-style dataset of ``seq_length + 1``-token windows over an unbounded stream of blocks.

    Block ``b`` is ``make_block(b, n)``: exactly ``n = windows_per_block * seq_length + 1``
    tokens, cut into non-overlapping windows (consecutive windows share one token, so every
    token is a label once). Sample ``i`` is window ``perm_b[i % windows_per_block]`` of
    block ``b = i // windows_per_block``, the permutation seeded by ``(seed, split_index, b)``.
    So a sample depends on its index and on what ``make_block`` depends on, never on how many
    samples a run asks for (``num_samples`` only sets the length): a 3-iteration run sees the
    same first batches as a 5-iteration one. Any rank builds any sample alone, and samples are
    read in order, so holding the last two blocks bounds memory.
    """

    def __init__(self, make_block: Callable[[int, int], np.ndarray], windows_per_block: int,
                 seq_length: int, num_samples: int, seed: int, split_index: int,
                 options=None, eod: int | None = None):
        if seq_length < 1:
            raise ConfigError(f"--seq-length must be at least 1, got {seq_length}")
        if windows_per_block < 1:
            raise ValueError(f"windows_per_block must be at least 1, got {windows_per_block}")
        self.make_block = make_block
        self.windows_per_block = windows_per_block
        self.seq_length = seq_length
        self.num_samples = max(1, num_samples)
        self.seed = seed
        self.split_index = split_index
        self.options, self.eod = options, eod
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._blocks_lock = threading.Lock()  # --num-workers threads share the cache

    @property
    def block_tokens(self) -> int:
        return self.windows_per_block * self.seq_length + 1

    def __len__(self) -> int:
        return self.num_samples

    def block(self, index: int) -> np.ndarray:
        """The tokens of block ``index``."""
        return self._block(index)[0]

    def _block(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        with self._blocks_lock:
            return self._block_locked(index)

    def _block_locked(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if index not in self._blocks:
            tokens = self.make_block(index, self.block_tokens)
            if len(tokens) != self.block_tokens:
                raise ValueError(f"block {index} has {len(tokens)} tokens, not "
                                 f"{self.block_tokens}")
            order = seeded_rng(self.seed, _BLOCK_ORDER_TAG, self.split_index, index) \
                .permutation(self.windows_per_block)
            self._blocks[index] = (tokens, order)
            while len(self._blocks) > 2:
                self._blocks.popitem(last=False)
        return self._blocks[index]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)}")
        block, position = divmod(index, self.windows_per_block)
        tokens, order = self._block(block)
        start = int(order[position]) * self.seq_length
        return make_sample(tokens[start:start + self.seq_length + 1], self.options, self.eod)
