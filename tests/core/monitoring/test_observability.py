"""Memory in the metrics, --profile traces, and plugtron plot."""

from __future__ import annotations

import json

from click.testing import CliRunner
from plugtron.cli.main import cli

ARGS = ["--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters", "3",
        "--no-progress", "--eval-interval", "2", "--eval-iters", "1", "--hidden-dropout", "0"]


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_memory_in_metrics_and_a_profile_trace(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = invoke(["train", *ARGS, "--metrics-file", str(metrics), "--profile",
                     "--profile-step-start", "2", "--profile-step-end", "3",
                     "--profile-dir", str(tmp_path / "prof")])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in steps if "grad_norm" in r]
    assert all(r["memory_mb"] > 10 for r in steps)  # a process with torch holds > 10 MiB
    trace = tmp_path / "prof" / "rank0.trace.json"
    assert f"written to {trace}" in result.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)


def test_the_tracers_own_lines_do_not_reach_the_console(tmp_path):
    """torch's tracer writes USDT/STAGE lines to the process's stderr at every start and stop;
    --profile keeps them out (and lets any other line through)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "plugtron.cli.main", "train", *ARGS,
                             "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
                             "--profile-dir", str(tmp_path / "prof")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "written to" in result.stdout
    assert "USDT:" not in result.stderr + result.stdout
    assert "profiler_start" not in result.stderr + result.stdout


def test_profile_steps_are_checked():
    result = invoke(["train", *ARGS, "--profile", "--profile-step-start", "5",
                     "--profile-step-end", "2"])
    assert result.exit_code == 2
    assert "need 1 <= --profile-step-start (5) <= --profile-step-end (2)" in result.output


def test_plot_overlays_runs_into_a_png(tmp_path):
    import matplotlib.image

    files = []
    for lr in ("1e-3", "3e-3"):
        path = tmp_path / f"lr{lr}.jsonl"
        assert invoke(["train", *ARGS, "--lr", lr, "--metrics-file", str(path)]).exit_code == 0
        files.append(str(path))
    out = tmp_path / "curves.png"
    result = invoke(["plot", *files, "-o", str(out)])
    assert result.exit_code == 0, result.output
    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 300 and image.shape[1] > 500
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = invoke(["plot", str(bad)])
    assert result.exit_code == 2 and "line 1 is not JSON" in result.output
