"""``--data text`` never reads a Megatron corpus or plugtron's index cache as text (after an
indexed run, ``PREFIX/cache/`` beside ``PREFIX.bin``/``.idx`` held description files that a
text run read as its corpus, and evaluated a checkpoint on them without a word)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli

from tests.indexed_helpers import write_corpus
from tests.utils import TINY


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "data" / "corpus_text_document")
    (tmp_path / "data").mkdir()
    write_corpus(prefix)
    cache = tmp_path / "data" / "corpus_text_document" / "cache" / "GPTDataset_indices"
    cache.mkdir(parents=True)
    (cache / "abc-GPTDataset-train-description.json").write_text(json.dumps({"x": 1}))
    return prefix


def _train(*args):
    flags = [f"--{k}" if v is True else f"--{k}={v}" for k, v in TINY.items()
             if k not in ("data", "vocab-size", "progress") and v is not False]
    return CliRunner().invoke(cli, ["train", *flags, "--no-progress", "--train-iters", "1",
                                    *args])


def test_a_megatron_prefix_given_to_text_data_is_refused_naming_indexed(corpus):
    result = _train("--data", "text", "--data-path", corpus)
    assert result.exit_code == 2, result.output
    assert "is a Megatron indexed corpus" in result.output
    assert "--data indexed --tokenizer-type" in result.output


def test_a_folder_holding_only_the_index_cache_is_refused(corpus, tmp_path):
    result = _train("--data", "text", "--data-path", str(tmp_path / "data" /
                                                         "corpus_text_document"))
    assert result.exit_code == 2  # the prefix itself: refused as above
    only_cache = tmp_path / "copy"
    (only_cache / "cache" / "GPTDataset_indices").mkdir(parents=True)
    (only_cache / "cache" / "GPTDataset_indices" / "d-description.json").write_text("{}")
    result = _train("--data", "text", "--data-path", str(only_cache))
    assert result.exit_code == 2, result.output
    assert "holds no text files" in result.output


def test_a_missing_path_suggests_indexed_for_a_prefix(tmp_path):
    result = _train("--data", "text", "--data-path", str(tmp_path / "nothing"))
    assert result.exit_code == 2
    assert "does not exist" in result.output


@pytest.mark.parametrize("data,flags,want", [
    ("mock", {}, 512), ("mock", {"vocab-size": 100}, 100), ("text", {}, 257),
    ("indexed", {}, None), ("indexed", {"tokenizer-type": "ByteTokenizer"}, 257)])
def test_hook_dataset_vocab_size(data, flags, want):
    """Each built-in dataset says its vocabulary before reading data (the estimate's and the
    memory check's): a synthetic one its own, the others their tokenizer's."""
    from plugtron.core.plugins import registry
    from plugtron.testing import make_config

    config = make_config({"data": data, **flags})
    if "vocab-size" not in flags:
        config.model.vocab_size = None  # the kit's defaults give one
    dataset = registry.instantiate(registry.load("dataset", data))
    assert dataset.dataset_vocab_size(config=config) == want
