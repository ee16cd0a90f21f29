"""`plugtron train` as a user runs it: the default job, and dp 2 against one process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PLUGTRON = [sys.executable, "-m", "plugtron.cli.main"]


def run_cli(args, cwd, timeout=900):
    return subprocess.run(PLUGTRON + args, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_default_train_learns_the_standard_library(tmp_path):
    """The README's main job (the default GPT on the stdlib text, every default as it is) cut
    to 30 of its 200 iterations to keep the suite short: the loss still falls from about 5.3
    to <= 60% of the first (2.92, 55%, on a 2-core AVX2 machine; 2.3 after the full run)."""
    result = run_cli(["train", "--train-iters", "30", "--eval-interval", "15"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    first = float(re.search(r"iteration +1/\d+ \| lm loss ([\d.]+)", result.stdout).group(1))
    summary = json.loads(result.stdout.split("summary: ", 1)[1].splitlines()[0])
    assert summary["final_lm_loss"] <= 0.6 * first, (first, summary)


def read_losses(path: Path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if "lm_loss" in r]


@pytest.mark.parametrize("dataset", ["mock", "text"])
def test_two_ranks_match_one_rank(tmp_path, dataset):
    """dp 2 (torchrun, gloo) gives the same loss at every iteration as one process with the
    same global batch (fp32, relative 1e-5)."""
    common = ["train", "--preset", "tiny", "--data", dataset, "--train-iters", "6",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0",
              "--no-progress"]
    if dataset == "mock":
        common += ["--vocab-size", "128"]
    one = run_cli(common + ["--metrics-file", str(tmp_path / "one.jsonl")], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(common + ["--nproc-per-node", "2", "--metrics-file",
                            str(tmp_path / "two.jsonl")], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = read_losses(tmp_path / "one.jsonl"), read_losses(tmp_path / "two.jsonl")
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
        assert y["consumed_samples"] == x["consumed_samples"]


def test_mock_data_does_not_depend_on_the_run_length(tmp_path):
    """Same seed: a 3-iteration run starts on the same batch as a 5-iteration one, so its first
    loss (before any step, which the run length's LR schedule would change) is identical."""
    common = ["train", "--preset", "tiny", "--data", "mock", "--vocab-size", "128",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0",
              "--no-progress"]
    first = []
    for iters in (3, 5):
        metrics = tmp_path / f"iters{iters}.jsonl"
        result = run_cli(common + ["--train-iters", str(iters), "--metrics-file", str(metrics)],
                         tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        records = read_losses(metrics)
        assert len(records) == iters and records[0]["iteration"] == 1
        first.append(records[0]["lm_loss"])
    assert first[0] == first[1]


def test_user_error_inside_ranks_exits_2_without_traceback(tmp_path):
    """Errors found only once ranks run (here: a corpus folder without text files) still exit
    2 cleanly."""
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli(["train", "--preset", "tiny", "--nproc-per-node", "2", "--data-path",
                      str(empty), "--no-progress"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "holds no text files" in result.stderr
    assert "Traceback" not in result.stderr
