"""Refused before any rank starts (exit 2, seconds): unwritable --save/--metrics-file,
non-finite floats, sizes that cannot fit; the metrics file is strict JSON with a run id."""

from __future__ import annotations

import json
import os

import pytest

from .tools import run_cli, tiny_flags


def _cases(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return [
        (["--save", str(blocker / "ckpt")], "is a file"),
        (["--save", str(blocker)], "is a file"),
        (["--metrics-file", str(blocker / "m.jsonl")], "is a file"),
        (["--metrics-file", str(tmp_path)], "is a directory"),
        (["--lr", "nan"], "finite"),
        (["--lr", "inf"], "finite"),
        (["--clip-grad", "-inf"], "finite"),
        (["--hidden-size", "65536", "--num-attention-heads", "64"], "GiB per rank"),
        (["--micro-batch-size", "100000", "--global-batch-size", "200000", "--seq-length", "512"],
         "GiB per rank"),
    ] + ([] if os.geteuid() == 0 else [(["--save", str(locked / "ckpt")], "not writable")])


def test_refused_before_launch(tmp_path):
    """The first case as a user meets it (a process, its exit code), the others in this one:
    each would pay a process start for a check that runs before any rank starts."""
    from click.testing import CliRunner
    from plugtron.cli.main import cli

    (first, first_words), *others = _cases(tmp_path)
    done = run_cli(["train", *tiny_flags(), "--nproc-per-node", "2", *first], timeout=60)
    assert done.rc == 2, (first, done.out)
    assert first_words in done.out and "Traceback" not in done.out, (first, done.out)
    assert "iteration" not in done.out and done.seconds < 30, (first, done.out)
    for extra, words in others:
        result = CliRunner().invoke(cli, ["train", *tiny_flags(), "--nproc-per-node", "2",
                                          *extra], catch_exceptions=False)
        assert result.exit_code == 2, (extra, result.output)
        assert words in result.output and "iteration" not in result.output, (extra,
                                                                             result.output)


@pytest.mark.parametrize("nan", [False, True])
def test_metrics_file_is_strict_json_with_a_run_id(tmp_path, nan):
    metrics = tmp_path / "m.jsonl"
    for _ in range(2):
        extra = ["--lr", "1e30", "--clip-grad", "0"] if nan else []
        done = run_cli(["train", *tiny_flags(train_iters=3), *extra, "--metrics-file",
                        str(metrics)])
        assert done.rc in (0, 2), done.out
    lines = metrics.read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
               for line in lines]
    assert all(isinstance(r, dict) and r.get("run_id") for r in records)
    assert len({r["run_id"] for r in records}) == 2
