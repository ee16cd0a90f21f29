"""The built-in dataset providers: sample layout, determinism, document splits, errors."""

from __future__ import annotations

import time
from itertools import chain

import numpy as np
import pluggy
import pytest
import torch
from plugtron.core.config import TrainConfig
from plugtron.core.contracts import hookspecs
from plugtron.core.errors import ConfigError
from plugtron.plugins.datasets.common import (
    BlockWindowDataset,
    TokenWindowDataset,
    parse_split,
    split_counts,
    split_documents,
)
from plugtron.plugins.datasets.mock import (
    BRANCHING,
    MAX_ARITHMETIC_STEP,
    MockDataset,
    windows_per_block,
)
from plugtron.plugins.datasets.text import TextDataset
from plugtron.plugins.tokenizers.byte import ByteTokenizer

SAMPLE_KEYS = {"tokens", "labels", "loss_mask", "position_ids"}


def make_config(seq_length=16, seed=1234, data_path=(), split="969,30,1", vocab_size=None):
    config = TrainConfig()
    config.model.seq_length = seq_length
    config.model.vocab_size = vocab_size
    config.training.seed = seed
    config.data.data_path = list(data_path)
    config.data.split = split
    return config


def check_sample_layout(sample, seq_length):
    assert set(sample) == SAMPLE_KEYS
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64)):
        assert sample[key].dtype == dtype and sample[key].shape == (seq_length,), key
    assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
    assert torch.equal(sample["position_ids"], torch.arange(seq_length))
    assert torch.all(sample["loss_mask"] == 1)


def decoded_documents(dataset: TokenWindowDataset) -> list[str]:
    """The documents of a split's stream, read back from between the EOD tokens."""
    tokenizer = ByteTokenizer()
    stream = dataset.stream.tolist()
    assert stream[-1] == tokenizer.eod, "every document, the last included, ends with EOD"
    return tokenizer.decode(stream).split(tokenizer.eod_text)[:-1]


# --------------------------------------------------------------------------- shared helpers


def test_parse_split_normalises_and_pads():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    for bad in ("a,b,c", "1,2,3,4", "0,0,0", "-1,2,0", ""):
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)


def test_split_counts_give_small_splits_a_document():
    assert split_counts(3, parse_split("969,30,1")) == [1, 1, 1]
    assert split_counts(5, parse_split("969,30,1")) == [3, 1, 1]
    assert split_counts(2, parse_split("969,30,1")) == [2, 0, 0]  # too few for three splits
    assert split_counts(5, parse_split("100,0,0")) == [5, 0, 0]
    assert split_counts(1000, parse_split("969,30,1")) == [969, 30, 1]
    parts = split_documents(10, parse_split("8,1,1"), np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))


def test_window_dataset_visits_every_window_once_per_epoch_and_wraps():
    stream = np.arange(101, dtype=np.uint16)
    dataset = TokenWindowDataset(stream, seq_length=10, num_samples=25, seed=7, split_index=0)
    assert dataset.windows_per_epoch == 10 and len(dataset) == 30  # whole epochs covering 25
    starts = [dataset.window_start(i) for i in range(len(dataset))]
    for epoch in range(3):
        assert sorted(starts[epoch * 10:(epoch + 1) * 10]) == list(range(0, 100, 10))
    assert starts[:10] != starts[10:20], "each epoch has its own order"
    sample = dataset[3]
    check_sample_layout(sample, 10)
    assert sample["tokens"][0] == starts[3] and sample["labels"][-1] == starts[3] + 10
    with pytest.raises(IndexError):
        dataset[30]


def test_window_dataset_repeats_a_stream_shorter_than_one_window():
    dataset = TokenWindowDataset(np.array([5, 6, 7], dtype=np.uint16), seq_length=8,
                                 num_samples=2, seed=0, split_index=1)
    assert len(dataset) >= 2
    assert dataset[0]["tokens"][:4].tolist() == [5, 6, 7, 5]


# --------------------------------------------------------------------------- mock


def test_mock_same_seed_same_samples_different_seed_different():
    sizes = (64, 8, 8)
    first = MockDataset().dataset_provider(make_config(seed=1), sizes)
    again = MockDataset().dataset_provider(make_config(seed=1), sizes)
    other = MockDataset().dataset_provider(make_config(seed=2), sizes)
    for split in range(3):
        for index in (0, 5, len(first[split]) - 1):
            a, b = first[split][index], again[split][index]
            assert all(torch.equal(a[key], b[key]) for key in SAMPLE_KEYS)
    assert not torch.equal(first[0][0]["tokens"], other[0][0]["tokens"])
    assert not torch.equal(first[0][0]["tokens"], first[1][0]["tokens"]), \
        "splits draw different documents"


def test_mock_layout_sizes_and_vocab():
    config = make_config(seq_length=32)
    train, valid, test = MockDataset().dataset_provider(config, (100, 10, 0))
    assert config.model.vocab_size == 512
    assert len(train) >= 100 and len(valid) >= 10 and test is None
    for index in (0, 99):
        sample = train[index]
        check_sample_layout(sample, 32)
        assert 0 <= int(sample["tokens"].min()) and int(sample["tokens"].max()) < 512
    config = make_config(vocab_size=1000)
    train, _, _ = MockDataset().dataset_provider(config, (4, 1, 1))
    assert config.model.vocab_size == 1000
    with pytest.raises(ConfigError, match="vocab-size"):
        MockDataset().dataset_provider(make_config(vocab_size=1), (4, 1, 1))


def test_mock_documents_follow_a_learnable_grammar():
    """Each token has few possible successors (arithmetic steps, Markov branches, EOD), so next
    token prediction can beat the uniform log(vocab) loss by far."""
    train, _, _ = MockDataset().dataset_provider(make_config(), (2000, 0, 0))
    stream = train.block(0).astype(np.int64)
    eod = 511
    successors: dict[int, set] = {}
    for current, following in zip(stream[:-1].tolist(), stream[1:].tolist()):
        if current != eod:
            successors.setdefault(current, set()).add(following)
    assert np.count_nonzero(stream == eod) > 10
    assert max(len(s) for s in successors.values()) <= MAX_ARITHMETIC_STEP + BRANCHING + 1


def test_mock_sample_depends_only_on_seed_dataset_and_index():
    """Not on how many samples a run asks for (--train-iters): any sample, in any block, is the
    same whatever the split sizes."""
    short = MockDataset().dataset_provider(make_config(), (24, 8, 8))
    long = MockDataset().dataset_provider(make_config(), (200_000, 80, 8))
    per_block = long[0].windows_per_block
    assert per_block == windows_per_block(16) and 200_000 > 4 * per_block
    for split in range(3):
        for index in (0, 7, len(short[split]) - 1):
            a, b = short[split][index], long[split][index]
            assert all(torch.equal(a[key], b[key]) for key in SAMPLE_KEYS), (split, index)
    # A later block is made on its own (without the ones before) and alike in every dataset.
    far = MockDataset().dataset_provider(make_config(), (200_000, 0, 0))[0]
    for index in (3 * per_block + 5, per_block, per_block - 1):
        assert torch.equal(far[index]["tokens"], long[0][index]["tokens"])
    # A different sequence length is a different dataset.
    other = MockDataset().dataset_provider(make_config(seq_length=32), (24, 8, 8))[0]
    assert not torch.equal(other[0]["tokens"][:16], short[0][0]["tokens"])


def test_block_windows_cover_each_block_once_in_a_shuffled_order():
    blocks = {}

    def make_block(index, num_tokens):
        blocks[index] = np.arange(num_tokens, dtype=np.int64) + 1000 * index
        return blocks[index]

    dataset = BlockWindowDataset(make_block, windows_per_block=4, seq_length=10,
                                 num_samples=10, seed=3, split_index=0)
    assert dataset.windows_per_block == 4 and dataset.block_tokens == 41 and len(dataset) == 10
    starts = [int(dataset[i]["tokens"][0]) for i in range(8)]
    assert sorted(starts[:4]) == [0, 10, 20, 30] and starts[:4] != [0, 10, 20, 30]
    assert sorted(starts[4:]) == [1000, 1010, 1020, 1030]
    assert int(dataset[3]["labels"][-1]) == int(dataset[3]["tokens"][-1]) + 1
    with pytest.raises(IndexError):
        dataset[10]


def test_mock_registers_as_a_pluggy_plugin():
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(MockDataset())
    train, valid, test = manager.hook.dataset_provider(config=make_config(),
                                                       split_sizes=(8, 2, 2), parallel=None)
    assert len(train) >= 8 and len(valid) >= 2 and len(test) >= 2


# --------------------------------------------------------------------------- text


@pytest.fixture
def corpus(tmp_path):
    """Five text documents in nested folders, plus files the walk must skip."""
    texts = {
        "a.txt": "alpha document, plain text\n" * 3,
        "b.md": "# beta\n\nmarkdown body with ümlauts\n",
        "sub/c.py": "def gamma():\n    return 'gamma'\n",
        "sub/deeper/d.rst": "Delta\n=====\n\nrestructured text\n" * 2,
        "e.json": '{"epsilon": [1, 2, 3]}\n',
    }
    for name, text in texts.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (tmp_path / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00binary")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "image.png").write_bytes(b"\x89PNG not text by suffix")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.txt").write_text("hidden folders are skipped\n")
    return tmp_path, sorted(texts.values())


def test_text_samples_shift_and_match_the_stream(corpus):
    folder, _ = corpus
    config = make_config(seq_length=16, data_path=[str(folder)])
    train, _, _ = TextDataset().dataset_provider(config, (40, 2, 2))
    assert config.model.vocab_size == 257
    for index in (0, 1, len(train) - 1):
        sample = train[index]
        check_sample_layout(sample, 16)
        start = train.window_start(index)
        window = torch.from_numpy(train.stream[start:start + 17].astype(np.int64))
        assert torch.equal(sample["tokens"], window[:-1])
        assert torch.equal(sample["labels"], window[1:])


def test_text_splits_by_whole_documents_with_eod_after_each(corpus):
    folder, texts = corpus
    config = make_config(data_path=[str(folder)])
    splits = TextDataset().dataset_provider(config, (500, 3, 3))
    documents = [decoded_documents(split) for split in splits]
    assert [len(d) for d in documents] == [3, 1, 1]
    assert sorted(chain(*documents)) == texts, "each document once, in exactly one split"
    train, valid, test = splits
    assert len(train) >= 500 and len(valid) >= 3 and len(test) >= 3
    # Same seed: same split; another seed: another document order.
    again = TextDataset().dataset_provider(make_config(data_path=[str(folder)]), (500, 3, 3))
    assert [decoded_documents(split) for split in again] == documents
    orders = set()
    for seed in range(6):
        seeded = TextDataset().dataset_provider(make_config(data_path=[str(folder)], seed=seed),
                                                (5, 1, 1))
        orders.add(tuple(chain(*(decoded_documents(split) for split in seeded))))
    assert len(orders) > 1


def test_text_split_sizes_zero_and_named_files(corpus):
    folder, _ = corpus
    config = make_config(data_path=[str(folder / "a.txt"), str(folder / "sub" / "c.py")])
    train, valid, test = TextDataset().dataset_provider(config, (10, 0, 5))
    assert valid is None
    assert test is None, "two documents are too few to give the test split one"
    assert len(decoded_documents(train)) == 2 and len(train) >= 10


def test_text_errors_name_the_problem(tmp_path, corpus):
    folder, _ = corpus
    missing = tmp_path / "no-such-folder"
    with pytest.raises(ConfigError, match="no-such-folder"):
        TextDataset().dataset_provider(make_config(data_path=[str(missing)]), (4, 1, 1))
    empty = tmp_path / "empty-corpus"
    empty.mkdir()
    (empty / "only-binary.txt").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ConfigError, match="no text documents"):
        TextDataset().dataset_provider(make_config(data_path=[str(empty)]), (4, 1, 1))
    with pytest.raises(ConfigError, match="vocab-size"):
        TextDataset().dataset_provider(make_config(data_path=[str(folder)], vocab_size=128),
                                       (4, 1, 1))
    with pytest.raises(ConfigError, match="does not match tokenizer ByteTokenizer"):
        TextDataset().dataset_provider(make_config(data_path=[str(folder)], vocab_size=512),
                                       (4, 1, 1))


def test_default_corpus_is_the_stdlib_and_reads_as_python():
    config = make_config(seq_length=512)
    started = time.perf_counter()
    train, valid, test = TextDataset().dataset_provider(config, (100, 10, 10))
    seconds = time.perf_counter() - started
    total = train.num_tokens + valid.num_tokens + test.num_tokens
    print(f"stdlib text corpus: {total:,} tokens built in {seconds:.2f} s")
    assert total > 1_000_000 and train.stream.dtype == np.uint16
    text = ByteTokenizer().decode(train[0]["tokens"])
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text) / len(text)
    assert printable > 0.95, text
