"""Megatron's GPTDataset and BlendedDataset sample order: the numpy implementation against an
independent, literal re-derivation of Megatron-Core's algorithm (the C++ walk of
build_sample_idx, the epoch rules), and against megatron-core itself when it is installed."""

from __future__ import annotations

import numpy as np
import pytest
from plugtron.plugins.datasets import gpt_indices
from plugtron.plugins.datasets.gpt_dataset import Tokens, build_gpt_split
from plugtron.plugins.datasets.indexed_format import IndexedCorpus

from tests.indexed_helpers import EOD, VOCAB, write_corpus

# --------------------------------------------------------------------------- the re-derivation


def reference_indices(sizes, documents, seq, num_samples, seed):
    """Megatron-Core's GPTDataset index build, step by step, in plain Python loops."""
    tokens_per_epoch = sum(int(sizes[d]) for d in documents)
    epochs = 1
    while epochs * tokens_per_epoch < num_samples * seq + 1:
        epochs += 1
    separate = False
    if epochs > 1:
        before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq
        per_epoch = (tokens_per_epoch - 1) // seq
        separate = (num_samples - before_last) < int(0.8 * per_epoch)
    rng = np.random.RandomState(seed)

    def shuffled_epochs(count):
        index = np.array([d for _ in range(count) for d in documents], dtype=np.int32)
        rng.shuffle(index)
        return list(index)

    doc_index = (shuffled_epochs(epochs - 1) + shuffled_epochs(1)) if separate \
        else shuffled_epochs(epochs)
    # helpers.cpp build_sample_idx, line by line.
    total = (epochs * tokens_per_epoch - 1) // seq
    samples = [(0, 0)]
    position, offset = 0, 0
    while len(samples) <= total:
        remaining = seq + 1
        while remaining != 0:
            length = int(sizes[doc_index[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                if position == len(doc_index) - 1:
                    offset = int(sizes[doc_index[position]]) - 1
                    break
                position += 1
                offset = 0
        samples.append((position, offset))
    first = before_last if separate else total
    shuffle_first = np.arange(first, dtype=np.uint32)
    rng.shuffle(shuffle_first)
    shuffle = list(shuffle_first)
    if first != total:
        shuffle_last = np.arange(first, total, dtype=np.uint32)
        rng.shuffle(shuffle_last)
        shuffle += list(shuffle_last)
    return np.array(doc_index), np.array(samples), np.array(shuffle)


@pytest.mark.parametrize("seq,num_samples,seed,empty_every", [
    (16, 10, 1234, 0),      # one epoch
    (16, 200, 1234, 0),     # several epochs
    (7, 333, 5, 3),         # empty documents, odd length
    (32, 150, 99, 0),       # last epoch separate or not, by the 80% rule
    (2, 50, 0, 2),
])
def test_numpy_indices_equal_the_literal_algorithm(tmp_path, seq, num_samples, seed,
                                                   empty_every):
    write_corpus(tmp_path / "c", num_documents=30, seed=seed, empty_every=empty_every)
    corpus = IndexedCorpus(tmp_path / "c")
    sizes = np.asarray(corpus.sequence_lengths)
    documents = np.arange(3, 27, dtype=np.int32)
    ours = gpt_indices.build_gpt_indices(sizes, documents, seq, num_samples, seed)
    reference = reference_indices(sizes, list(documents), seq, num_samples, seed)
    for name, a, b in zip(("document", "sample", "shuffle"), ours, reference):
        assert np.array_equal(np.asarray(a), b), name
    assert ours[0].dtype == np.int32 and ours[1].dtype == np.int32
    assert ours[2].dtype == np.uint32


def test_the_separate_final_epoch_rule_is_exercised():
    # 1000 tokens per epoch, seq 10: 99 samples per epoch.
    assert gpt_indices.separate_final_epoch(2, 1000, 100, 10) == (True, 99)
    # int(0.8 x 99) = 79: the last epoch is apart below 79 of its samples.
    assert gpt_indices.separate_final_epoch(2, 1000, 99 + 78, 10) == (True, 99)
    assert gpt_indices.separate_final_epoch(2, 1000, 99 + 79, 10)[0] is False


def test_split_bookends_and_ranges_follow_megatron():
    assert gpt_indices.split_bookends("969,30,1")[0] == (0, 0.969)
    assert gpt_indices.split_bookends("98,2")[2] is None
    bookends = gpt_indices.split_bookends("969,30,1")
    assert [gpt_indices.split_range(1000, b) for b in bookends] == [(0, 969), (969, 999),
                                                                     (999, 1000)]


def test_blending_greedy_rule_literal():
    weights = gpt_indices.normalize([0.3, 0.7])
    dataset_index, sample_index = gpt_indices.build_blending_indices(weights, 20)
    counts, expected = [0, 0], []
    for s in range(20):
        errors = [w * max(s, 1) - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))
        expected.append((best, counts[best]))
        counts[best] += 1
    assert list(zip(dataset_index.tolist(), sample_index.tolist())) == expected
    assert gpt_indices.blend_sizes(weights, 1000, 0.005) == [302, 704]


def test_compiled_helpers_equal_numpy_and_python(monkeypatch):
    """index_helpers.so (blending, sample index) against the pure paths, empty documents too."""
    if gpt_indices._helpers() is None:
        pytest.skip("index_helpers.so not built (make install compiles it)")
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 40, size=300).astype(np.int32)
    sizes[[0, 7, 8]] = 0
    documents = rng.permutation(np.tile(np.arange(300, dtype=np.int32), 2))
    tokens = int(sizes.sum())
    weights = gpt_indices.normalize([0.11, 0.5, 0.05, 0.34, 0.0])

    def build():
        return (*gpt_indices.build_blending_indices(weights, 5000),
                gpt_indices.build_sample_index(sizes, documents, 16, 2, tokens))

    compiled = build()
    monkeypatch.setenv("PLUGTRON_NO_INDEX_HELPERS", "1")
    gpt_indices._helpers.cache_clear()
    try:
        pure = build()
    finally:
        gpt_indices._helpers.cache_clear()
    for a, b in zip(compiled, pure):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def blend_weight_cases():
    """Ties (equal weights, so exact-tie breaking decides), zero weights, 1 to 10 datasets (the
    compiled register loop takes 2-8, its general loop the rest) and random weights."""
    rng = np.random.default_rng(5)
    cases = [[1.0], [0.5, 0.5], [1 / 3] * 3, [0.25] * 4, [0.2] * 5, [1 / 6] * 6, [1 / 7] * 7,
             [0.125] * 8, [1 / 9] * 9, [0.1] * 10, [0.0, 1.0], [0.3, 0.0, 0.7], [0.2, 0.5, 0.3]]
    for n in range(2, 11):
        w = rng.random(n) * (rng.random(n) > 0.25) + 1e-3
        cases.append(gpt_indices.normalize(w))
        cases.append(gpt_indices.normalize(rng.integers(1, 4, n)))  # many exact ties
    return cases


def test_compiled_blend_loops_equal_each_other_python_and_megatron(monkeypatch):
    """The register loop (2-8 datasets) against the compiled general loop, the Python loop and,
    when installed, Megatron-Core's build_blending_indices: the same integers and dtypes."""
    helpers = gpt_indices._helpers()
    if helpers is None:
        pytest.skip("index_helpers.so not built (make install compiles it)")
    try:
        from megatron.core.datasets import helpers_cpp
    except Exception:
        helpers_cpp = None
    for weights in blend_weight_cases():
        fast = gpt_indices.compiled_blend(helpers, weights, 4000)
        general = gpt_indices.compiled_blend(helpers, weights, 4000, general=True)
        for a, b in zip(fast, general):
            assert a.dtype == b.dtype and np.array_equal(a, b), weights
        assert fast[0].dtype == np.int16 and fast[1].dtype == np.int64
        for size in (0, 1, 2, 3):  # the first two samples share scale 1
            short = gpt_indices.compiled_blend(helpers, weights, size)
            assert all(np.array_equal(a, b[:size]) for a, b in zip(short, fast)), weights
        if helpers_cpp is not None:
            d, s = np.zeros(4000, dtype=np.int16), np.zeros(4000, dtype=np.int64)
            helpers_cpp.build_blending_indices(d, s, np.array(weights), len(weights), 4000, False)
            assert np.array_equal(d, fast[0]) and np.array_equal(s, fast[1]), weights
    monkeypatch.setenv("PLUGTRON_NO_INDEX_HELPERS", "1")
    gpt_indices._helpers.cache_clear()
    try:
        for weights in blend_weight_cases():
            pure = gpt_indices.build_blending_indices(weights, 600)
            fast = gpt_indices.compiled_blend(helpers, weights, 600)
            assert all(np.array_equal(a, b) for a, b in zip(pure, fast)), weights
    finally:
        gpt_indices._helpers.cache_clear()


# --------------------------------------------------------------------------- datasets


class NullTok:
    vocab_size, eod, eos, bos, pad = VOCAB, EOD, EOD, None, None
    unique_identifiers = {"class": "NullTok"}  # megatron-core puts it in its cache key


def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path):
    documents = write_corpus(tmp_path / "c", num_documents=25)
    corpus = IndexedCorpus(tmp_path / "c")
    dataset = build_gpt_split(corpus, (0.0, 1.0), "train", 100, 16, 7, str(tmp_path / "cache"),
                              Tokens(NullTok()))
    stream = np.concatenate([documents[d] for d in dataset.document_index])
    for i in range(len(dataset)):
        j = int(dataset.shuffle_index[i])
        window = stream[j * 16:j * 16 + 17]
        sample = dataset[i]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
    assert len(dataset) >= 100


def test_indices_are_cached_by_their_inputs_and_loaded_mapped(tmp_path, monkeypatch):
    write_corpus(tmp_path / "c")
    corpus = IndexedCorpus(tmp_path / "c")
    cache = str(tmp_path / "cache")
    first = build_gpt_split(corpus, (0.0, 1.0), "train", 50, 16, 7, cache, Tokens(NullTok()))
    assert isinstance(first.sample_index, np.memmap)
    calls = []
    real = gpt_indices.build_gpt_indices
    monkeypatch.setattr(gpt_indices, "build_gpt_indices",
                        lambda *a: calls.append(a) or real(*a))
    again = build_gpt_split(corpus, (0.0, 1.0), "train", 50, 16, 7, cache, Tokens(NullTok()))
    assert calls == [] and np.array_equal(again.shuffle_index, first.shuffle_index)
    build_gpt_split(corpus, (0.0, 1.0), "train", 50, 16, 8, cache, Tokens(NullTok()))
    build_gpt_split(corpus, (0.0, 1.0), "train", 50, 17, 7, cache, Tokens(NullTok()))
    build_gpt_split(corpus, (0.0, 0.5), "train", 50, 16, 7, cache, Tokens(NullTok()))
    assert len(calls) == 3, "seed, sequence length and split are part of the key"
    write_corpus(tmp_path / "c", seed=1)  # the corpus is rewritten
    build_gpt_split(IndexedCorpus(tmp_path / "c"), (0.0, 1.0), "train", 50, 16, 7, cache,
                    Tokens(NullTok()))
    assert len(calls) == 4


# --------------------------------------------------------------------------- megatron-core


def megatron_datasets(blend, split, sizes, seq, seed, cache, blend_per_split=None, **flags):
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=blend,
                              blend_per_split=blend_per_split, split=split,
                              path_to_cache=cache, tokenizer=NullTok(),
                              reset_position_ids=flags.get("reset_position_ids", False),
                              reset_attention_mask=flags.get("reset_attention_mask", False),
                              eod_mask_loss=flags.get("eod_mask_loss", False),
                              create_attention_mask=flags.get("reset_attention_mask", False))
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def plugtron_datasets(tmp_path, data_path, sizes, seq, seed, split="969,30,1", per_split=None,
                      **flags):
    from plugtron.core.config import TrainConfig
    from plugtron.core.plugins.options import with_plugin_sections
    from plugtron.plugins.datasets.indexed import IndexedDataset

    config = TrainConfig()
    config.plugins.data = "indexed"
    with_plugin_sections(config)
    config.data.data_path = list(data_path)
    config.data.split = split
    config.data.tokenizer_type = "NullTokenizer"
    config.model.vocab_size, config.model.seq_length = VOCAB, seq
    config.training.seed = seed
    config.indexed.data_cache_path = str(tmp_path / "plugtron-cache")
    for key, value in (per_split or {}).items():
        setattr(config.indexed, key, value)
    for key, value in flags.items():
        setattr(config.samples, key, value)
    return IndexedDataset().dataset_provider(config, sizes)


def assert_same_samples(ours, theirs, check_mask=False):
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), (i, key)
        if check_mask:
            numbers = a["attention_mask"].numpy()
            allowed = (numbers[:, None] == numbers[None, :]) & np.tri(len(numbers), dtype=bool)
            assert np.array_equal(allowed, ~np.asarray(b["attention_mask"][0])), i


@pytest.mark.parametrize("seq,sizes,seed", [(16, [300, 20, 5], 1234), (31, [40, 3, 1], 3)])
def test_same_samples_as_megatron_core_gpt_dataset(tmp_path, seq, sizes, seed):
    write_corpus(tmp_path / "c", num_documents=60, empty_every=7)
    # Not 969,30,1: a test split of no documents sends megatron-core into an endless loop.
    theirs = megatron_datasets([[str(tmp_path / "c")], None], "80,15,5", sizes, seq, seed,
                               str(tmp_path / "mcore-cache"))
    ours = plugtron_datasets(tmp_path, [str(tmp_path / "c")], sizes, seq, seed, split="80,15,5")
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            assert_same_samples(a, b)


def test_same_masks_and_positions_as_megatron_core(tmp_path):
    write_corpus(tmp_path / "c", num_documents=60, max_length=12)
    flags = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
    theirs = megatron_datasets([[str(tmp_path / "c")], None], "1,0,0", [50, 0, 0], 24, 1,
                               str(tmp_path / "mcore-cache"), **flags)
    ours = plugtron_datasets(tmp_path, [str(tmp_path / "c")], (50, 0, 0), 24, 1, split="1,0,0",
                             **flags)
    assert_same_samples(ours[0], theirs[0], check_mask=True)


def test_same_blend_as_megatron_core(tmp_path):
    write_corpus(tmp_path / "a", num_documents=50, seed=1)
    write_corpus(tmp_path / "b", num_documents=50, seed=2, max_length=30)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    theirs = megatron_datasets([[a, b], [0.3, 0.7]], "90,8,2", [200, 20, 4], 16, 5,
                               str(tmp_path / "mcore-cache"))
    ours = plugtron_datasets(tmp_path, ["0.3", a, "0.7", b], (200, 20, 4), 16, 5,
                             split="90,8,2")
    for x, y in zip(ours, theirs):
        assert_same_samples(x, y)
        assert np.array_equal(x.dataset_index, y.dataset_index)


def test_same_per_split_blends_as_megatron_core(tmp_path):
    write_corpus(tmp_path / "a", num_documents=50, seed=1)
    write_corpus(tmp_path / "b", num_documents=20, seed=2)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    theirs = megatron_datasets(None, None, [100, 10, 0], 16, 5, str(tmp_path / "mcore-cache"),
                               blend_per_split=[[[a, b], [1.0, 3.0]], [[b], None], None])
    ours = plugtron_datasets(tmp_path, [], (100, 10, 0), 16, 5, per_split={
        "train_data_path": ["1", a, "3", b], "valid_data_path": [b]})
    assert ours[2] is None and theirs[2] is None
    for x, y in zip(ours[:2], theirs[:2]):
        assert_same_samples(x, y)
