"""``plugtron data inspect`` and ``plugtron data stats`` on a tiny corpus: the samples a run
draws (ids, text, --json), a blend's documents, tokens, histogram, epochs and effective
weights; bad input exits with code 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.plugins.datasets.indexed_format import IndexedWriter
from plugtron.plugins.datasets.inspection import length_histogram

EOD = 256


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)  # .stdout: the report alone


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    prefixes = []
    for name, docs in (("a", [b"hello world"] * 40), ("b", [b"abc", b"a much longer one"] * 20)):
        with IndexedWriter(root / name, dtype="uint16") as writer:
            for doc in docs:
                writer.add_document(list(doc) + [EOD])
        prefixes.append(str(root / name))
    return root, prefixes


def run_flags(root, *paths):
    return ["--data", "indexed", "--tokenizer-type", "ByteTokenizer", "--data-path", *paths,
            "--seq-length", "8", "--global-batch-size", "4", "--train-iters", "5",
            "--eval-iters", "1", "--split", "90,10,0", "--data-cache-path", str(root / "cache")]


def test_inspect_shows_the_run_samples_with_text_and_json(corpora):
    root, (a, _) = corpora
    flags = run_flags(root, a)
    text = invoke(["data", "inspect", *flags, "--num-samples", "2", "--reset-attention-mask"])
    assert text.exit_code == 0, text.output
    assert "train split" in text.output and "sample 1:" in text.output
    assert "document(s)" in text.output and "text: '" in text.output
    out = invoke(["data", "inspect", *flags, "--num-samples", "3", "--start", "1", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout.strip().splitlines()[-1])
    samples = report["samples"]
    assert [s["index"] for s in samples] == [1, 2, 3] and report["tokenizer"] == "ByteTokenizer"
    for s in samples:
        assert len(s["tokens"]) == 8 and s["labels"][:-1] == s["tokens"][1:]
        assert s["text"].replace("<|eod|>", "") == bytes(
            t for t in s["tokens"] if t != EOD).decode()
    valid = invoke(["data", "inspect", *flags, "--split-name", "valid", "--json"])
    assert json.loads(valid.stdout.strip().splitlines()[-1])["split"] == "valid"


def test_stats_of_a_blend(corpora):
    root, (a, b) = corpora
    out = invoke(["data", "stats", *run_flags(root, "0.25", a, "0.75", b), "--json"])
    assert out.exit_code == 0, out.output
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    train = stats["splits"]["train"]
    assert train["needed"] == 20 and train["samples"] >= 20
    part_a, part_b = train["blend"]
    assert part_a["documents"] == 36 and part_a["tokens"] == 36 * 12
    assert part_b["documents"] == 36 and part_b["tokens"] == 18 * 4 + 18 * 18
    assert part_a["effective_weight"] == pytest.approx(0.25, abs=0.05)
    assert part_a["samples_drawn"] + part_b["samples_drawn"] == 20
    assert part_a["epochs"] >= 1 and part_a["length_histogram"] == [
        {"min": 8, "max": 15, "documents": 36}]
    assert stats["splits"]["test"]["samples"] == 0
    text = invoke(["data", "stats", *run_flags(root, "0.25", a, "0.75", b)])
    assert "effective" in text.output and "epoch(s)" in text.output


def test_length_histogram_bins_by_powers_of_two():
    assert length_histogram([1, 2, 3, 4, 9]) == [
        {"min": 1, "max": 1, "documents": 1}, {"min": 2, "max": 3, "documents": 2},
        {"min": 4, "max": 7, "documents": 1}, {"min": 8, "max": 15, "documents": 1}]


@pytest.mark.parametrize("bad", [["--data-path", "missing"], ["--split-name", "dev"],
                                 ["--start", "100000"]])
def test_bad_input_exits_2(corpora, bad):
    root, (a, _) = corpora
    flags = run_flags(root, a)
    if bad[0] == "--data-path":
        flags = run_flags(root, "missing")
        bad = []
    out = invoke(["data", "inspect", *flags, *bad])
    assert out.exit_code == 2, out.output
    assert "Traceback" not in out.output
