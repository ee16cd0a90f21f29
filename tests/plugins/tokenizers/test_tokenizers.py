"""Tokenizers (entry-point group plugtron.tokenizers): the three built-ins, the vocabulary they
fix, the name the config records, and the refusal of a tokenizer that does not match a
checkpoint."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint.loader import check_tokenizer
from plugtron.core.config import TrainConfig
from plugtron.core.errors import CheckpointError, ConfigError, PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.tokenizers import build_tokenizer, tokenizer_for
from plugtron.plugins.datasets.text import TextDataset

from tests.tokenizer_helpers import WORDS, save_tiny_hf_tokenizer


def test_the_three_tokenizers_are_entry_points_with_megatrons_names():
    names = [info.name for info in registry.available("tokenizer")]
    assert names == ["ByteTokenizer", "HuggingFaceTokenizer", "NullTokenizer"]
    with pytest.raises(PluginError, match="unknown tokenizer 'GPT3'; available: ByteTokenizer"):
        build_tokenizer("GPT3")


def test_byte_tokenizer_round_trip():
    tokenizer = build_tokenizer("ByteTokenizer")
    text = "héllo, wörld\n"
    ids = tokenizer.tokenize(text)
    assert max(ids) < 256 and tokenizer.detokenize(ids) == text
    assert tokenizer.detokenize(ids + [tokenizer.eod]) == text + tokenizer.eod_text
    assert tokenizer.detokenize(torch.tensor([0xC3])) == "\ufffd", "broken UTF-8 is replaced"
    assert tokenizer.vocab_size == 257 and tokenizer.eod == 256


def test_null_tokenizer_reads_ids_and_needs_a_vocab_size():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tokenizer.vocab_size == 100 and tokenizer.eod == 99
    assert tokenizer.tokenize("3 14  15\n9") == [3, 14, 15, 9]
    assert tokenizer.detokenize([3, 14]) == "3 14"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.tokenize("100")
    with pytest.raises(ConfigError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")


@pytest.fixture
def hf_dir(tmp_path):
    pytest.importorskip("transformers")
    return save_tiny_hf_tokenizer(tmp_path / "tok")


def test_hf_tokenizer_loads_a_local_folder_or_file(hf_dir):
    for model in (hf_dir, hf_dir / "tokenizer.json"):
        tokenizer = build_tokenizer("HuggingFaceTokenizer", str(model))
        assert tokenizer.vocab_size == 3 + len(set(WORDS))
        assert tokenizer.eod == tokenizer.eos == 1
        ids = tokenizer.tokenize("hello world")
        assert ids == [3 + WORDS.index("hello"), 3 + WORDS.index("world")]
        assert tokenizer.detokenize(ids) == "hello world"


def test_hf_tokenizer_refuses_what_is_not_local(tmp_path):
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ConfigError, match="never downloads"):
        build_tokenizer("HuggingFaceTokenizer", "meta-llama/Llama-2-7b-hf")


def test_the_tokenizer_fixes_the_vocabulary_and_the_config_records_it(hf_dir):
    config = TrainConfig()
    config.data.tokenizer_type, config.data.tokenizer_model = "HuggingFaceTokenizer", str(hf_dir)
    tokenizer = tokenizer_for(config)
    assert config.model.vocab_size == tokenizer.vocab_size
    assert config.to_dict()["data"]["tokenizer_type"] == "HuggingFaceTokenizer"
    config = TrainConfig()
    config.model.vocab_size = 1000
    with pytest.raises(ConfigError, match="--vocab-size 1000 does not match tokenizer "
                                          "ByteTokenizer's vocabulary of 257"):
        tokenizer_for(config, default="ByteTokenizer")


def test_text_data_uses_the_tokenizer(hf_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text("the quick brown fox " * (i + 3))
    config = TrainConfig()
    config.model.seq_length = 8
    config.data.data_path = [str(corpus)]
    config.data.tokenizer_type, config.data.tokenizer_model = "HuggingFaceTokenizer", str(hf_dir)
    train, _, _ = TextDataset().dataset_provider(config, (8, 1, 1))
    tokens = torch.cat([train[i]["tokens"] for i in range(len(train))])
    assert tokens.max() < config.model.vocab_size and (tokens == 1).any(), "eod is eos"
    assert set(tokens.tolist()) <= {1, *(3 + WORDS.index(w) for w in "the quick brown fox".split())}


def test_a_checkpoint_with_another_vocabulary_is_refused():
    config = TrainConfig()
    config.data.tokenizer_type, config.model.vocab_size = "ByteTokenizer", 257
    check_tokenizer({"model": {"vocab_size": 257}}, config)
    with pytest.raises(CheckpointError, match="has 1000 tokens but this run's tokenizer "
                                              r"\(ByteTokenizer\) gives 257"):
        check_tokenizer({"model": {"vocab_size": 1000}, "data": {}}, config)


def test_cli_resume_with_a_mismatched_tokenizer_exits_2(tmp_path, hf_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 200)
    (corpus / "b.txt").write_text("the lazy dog " * 200)
    base = ["train", "--preset", "tiny", "--data", "text", "--data-path", str(corpus),
            "--train-iters", "1", "--no-progress", "--eval-interval", "0", "--split", "1,0,0"]
    saved = CliRunner().invoke(cli, [*base, "--save", str(tmp_path / "ckpt")],
                               catch_exceptions=False)
    assert saved.exit_code == 0, saved.output
    result = CliRunner().invoke(cli, [*base, "--train-iters", "2", "--load", str(tmp_path / "ckpt"),
                                      "--tokenizer-type", "HuggingFaceTokenizer",
                                      "--tokenizer-model", str(hf_dir)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "trained with --tokenizer-type ByteTokenizer" in result.output
    assert "Traceback" not in result.output


def test_evaluate_uses_the_checkpoint_tokenizer_and_refuses_another(tmp_path, hf_dir):
    """evaluate reads the tokenizer from the checkpoint's config; a tokenizer of another
    vocabulary is refused before launch (exit 2) by evaluate and by train --load, also when
    ranks would be launched."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 200)
    base = ["--data", "text", "--data-path", str(corpus), "--num-layers", "1", "--hidden-size",
            "16", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--no-progress", "--eval-interval", "0", "--split",
            "9,1,0", "--eval-iters", "1"]
    run = CliRunner().invoke(cli, ["train", *base, "--train-iters", "1", "--save",
                                   str(tmp_path / "ck")], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    ok = CliRunner().invoke(cli, ["evaluate", "--load", str(tmp_path / "ck"), "--data-path",
                                  str(corpus), "--no-progress"], catch_exceptions=False)
    assert ok.exit_code == 0, ok.output
    other = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]
    for args in (["evaluate", "--load", str(tmp_path / "ck"), *other],
                 ["train", *base, "--train-iters", "2", "--load", str(tmp_path / "ck"), *other,
                  "--nproc-per-node", "2"]):
        refused = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert refused.exit_code == 2, refused.output
        assert "trained with --tokenizer-type ByteTokenizer" in refused.output
        assert "Traceback" not in refused.output
