"""``plugtron data preprocess``: JSONL, text files and folders to Megatron's .bin/.idx; bad
lines named by line number; the same output with 1 or 2 workers; and a run trains on it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.plugins.datasets.indexed_format import IndexedCorpus

from tests.tokenizer_helpers import WORDS, save_tiny_hf_tokenizer


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": " ".join(WORDS[i % 7:i % 7 + 5]), "id": i}) for i in range(300)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_to_indexed_with_eod_and_the_same_bytes_for_two_workers(tmp_path, jsonl):
    pytest.importorskip("transformers")
    tok = save_tiny_hf_tokenizer(tmp_path / "tok")
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        result = invoke(["data", "preprocess", "--input", str(jsonl), "--tokenizer-type",
                         "HuggingFaceTokenizer", "--tokenizer-model", str(tok),
                         "--output-prefix", str(prefix), "--append-eod", "--workers",
                         str(workers), "--no-progress", "--json"])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.output.strip().splitlines()[-1])
        assert summary["documents"] == 300 and summary["tokens"] == 300 * 6
        assert summary["tokens_per_sec"] > 0
        outputs.append([(tmp_path / f"w{workers}_text_document{s}").read_bytes()
                        for s in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    corpus = IndexedCorpus(tmp_path / "w1_text_document")
    assert len(corpus) == corpus.num_documents == 300
    assert corpus[0].tolist() == [3 + WORDS.index(w) for w in WORDS[0:5]] + [1]


def test_bad_lines_are_refused_or_skipped_with_their_line_number(tmp_path, jsonl):
    lines = jsonl.read_text().splitlines()
    lines[4] = "{not json"
    lines[9] = json.dumps({"title": "no text"})
    lines[11] = ""
    jsonl.write_text("\n".join(lines) + "\n")
    base = ["data", "preprocess", "--input", str(jsonl), "--tokenizer-type", "ByteTokenizer",
            "--output-prefix", str(tmp_path / "out"), "--no-progress"]
    result = invoke(base)
    assert result.exit_code == 2 and f"{jsonl}:5: not valid JSON" in result.output
    assert "--skip-bad-lines" in result.output
    assert not (tmp_path / "out_text_document.bin").exists(), "nothing half-written"
    result = CliRunner().invoke(cli, [*base, "--skip-bad-lines"])
    assert result.exit_code == 0, result.output
    assert f"skipped {jsonl}:5: not valid JSON" in result.output
    assert f"skipped {jsonl}:10: no string field 'text'" in result.output
    assert "297 documents" in result.output and "2 bad lines skipped" in result.output
    assert "1 blank lines ignored" in result.output
    assert len(IndexedCorpus(tmp_path / "out_text_document")) == 297


def test_text_files_and_folders(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("héllo")
    (folder / "sub" / "b.md").write_text("world!")
    result = invoke(["data", "preprocess", "--input", str(folder), "--tokenizer-type",
                     "ByteTokenizer", "--output-prefix", str(tmp_path / "t"), "--append-eod",
                     "--no-progress"])
    assert result.exit_code == 0, result.output
    corpus = IndexedCorpus(tmp_path / "t_text_document")
    assert corpus[0].tolist() == list("héllo".encode()) + [256]
    assert corpus[1].tolist() == list(b"world!") + [256]


def test_train_on_a_preprocessed_blend_and_resume_bitwise(tmp_path, jsonl):
    for name in ("a", "b"):
        assert invoke(["data", "preprocess", "--input", str(jsonl), "--tokenizer-type",
                       "ByteTokenizer", "--output-prefix", str(tmp_path / name),
                       "--append-eod", "--no-progress"]).exit_code == 0
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    base = ["train", "--preset", "tiny", "--data", "indexed", "--tokenizer-type",
            "ByteTokenizer", "--data-path", "0.3", a, "0.7", b, "--seq-length", "32", "--split", "90,10,0",
            "--no-progress", "--eval-interval", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--data-cache-path", str(tmp_path / "cache")]

    def losses(path):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        return [r["lm_loss"] for r in records if "lm_loss" in r]

    whole = invoke([*base, "--train-iters", "6", "--save", str(tmp_path / "ck"),
                    "--save-interval", "3", "--metrics-file", str(tmp_path / "whole.jsonl")])
    assert whole.exit_code == 0, whole.output
    middle = sorted((tmp_path / "ck").glob("iter_*3"))[0]
    rest = invoke([*base, "--train-iters", "6", "--load", str(middle),
                   "--metrics-file", str(tmp_path / "rest.jsonl")])
    assert rest.exit_code == 0, rest.output
    assert losses(tmp_path / "rest.jsonl") == losses(tmp_path / "whole.jsonl")[3:]


@pytest.mark.parametrize("blend", [True, False], ids=["blend", "one-corpus"])
def test_a_larger_train_iters_resumes_bitwise_and_workers_change_nothing(tmp_path, jsonl, blend):
    """4 iterations saved, resumed to 8, equals an uninterrupted 8 (within the epochs built);
    the uninterrupted run prefetches with 2 threads, the others read inline."""
    for name in ("a", "b"):
        assert invoke(["data", "preprocess", "--input", str(jsonl), "--tokenizer-type",
                       "ByteTokenizer", "--output-prefix", str(tmp_path / name),
                       "--append-eod", "--no-progress"]).exit_code == 0
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    paths = ["0.4", a, "0.6", b] if blend else [a]
    base = ["train", "--data", "indexed", "--tokenizer-type", "ByteTokenizer", "--data-path",
            *paths, "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--split", "90,10,0", "--no-progress", "--eval-interval", "0", "--hidden-dropout",
            "0", "--attention-dropout", "0", "--data-cache-path", str(tmp_path / "cache")]

    def losses(path):
        return [r["lm_loss"] for r in map(json.loads, path.read_text().splitlines())
                if "lm_loss" in r]

    whole = invoke([*base, "--train-iters", "8", "--num-workers", "2",
                    "--metrics-file", str(tmp_path / "whole.jsonl")])
    assert whole.exit_code == 0, whole.output
    first = invoke([*base, "--train-iters", "4", "--num-workers", "0", "--save",
                    str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "first.jsonl")])
    assert first.exit_code == 0, first.output
    rest = invoke([*base, "--train-iters", "8", "--num-workers", "0", "--load",
                   str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "rest.jsonl")])
    assert rest.exit_code == 0, rest.output
    assert "differs from the first run" not in rest.output
    if blend:  # the blend's indices end at the first run's size: rebuilt, the same order
        assert "the sample order continues" in rest.output
    assert losses(tmp_path / "first.jsonl") == losses(tmp_path / "whole.jsonl")[:4]
    assert losses(tmp_path / "rest.jsonl") == losses(tmp_path / "whole.jsonl")[4:]
    records = [r for r in map(json.loads, (tmp_path / "whole.jsonl").read_text().splitlines())
               if "lm_loss" in r]
    assert len(records) == 8 and all(r["data_time_s"] >= 0 for r in records)


def test_num_workers_must_not_be_negative(tmp_path):
    result = invoke(["train", "--data", "mock", "--vocab-size", "64", "--num-workers", "-1",
                     "--train-iters", "1", "--no-progress"])
    assert result.exit_code == 2 and "--num-workers must be >= 0" in result.output
