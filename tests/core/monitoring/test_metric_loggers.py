"""The TensorBoard and W&B extensions log every metric of the metrics file: read back with
tensorboard's own event reader and from W&B's offline run files."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli


def run_cli(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


ARGS = ["--data", "mock", "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--max-position-embeddings", "8",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--vocab-size", "32",
        "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress"]


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_tensorboard_events_hold_every_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    done = run_cli(["train", *ARGS, "--tensorboard-dir", str(tb), "--metrics-file",
                    str(metrics)])
    assert done.exit_code == 0, done.output
    assert f"TensorBoard events go to {tb}" in done.output
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    records = _metrics(metrics)
    steps = [r for r in records if "lr" in r]
    evals = [r for r in records if "valid_lm_loss" in r]
    expected = {k for r in steps + evals for k, v in r.items()
                if k not in ("iteration", "run_id") and isinstance(v, (int, float))}
    assert expected <= tags, expected - tags
    loss = events.Scalars("lm_loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([r["lm_loss"] for r in steps], rel=1e-6)
    assert [e.step for e in events.Scalars("valid_lm_loss")] == [2, 4]
    assert "config/text_summary" in events.Tags()["tensors"]


def test_wandb_offline_run_holds_every_metric(tmp_path):
    """``plugtron train`` as its own process, as a user runs it: W&B's service writes the run
    file from another process and, in wandb 0.31, may not have flushed it when ``run.finish()``
    returns (seen here: 3 of 46 runs, 6 to 8 per process, read as the bare header right after
    ``finish``, complete after ``wandb.teardown()``); it is complete once the process has
    exited, which is when the file is read here."""
    pytest.importorskip("wandb")
    env = {**os.environ, "WANDB_SILENT": "true", "HOME": str(tmp_path)}  # no ~/.netrc key
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        env.pop(name, None)
    save, metrics = tmp_path / "wb", tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "plugtron.cli.main", "train", *ARGS,
                           "--wandb-project", "plugtron-test", "--wandb-exp-name", "tiny",
                           "--wandb-save-dir", str(save), "--metrics-file", str(metrics)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "offline under" in done.stdout  # no API key: offline, no network
    runs = glob.glob(str(save / "wandb" / "offline-run-*"))
    assert len(runs) == 1, os.listdir(save)
    kinds, history = _wandb_records(glob.glob(os.path.join(runs[0], "*.wandb"))[0])
    assert "run" in kinds and "exit" in kinds, kinds
    logged = {h["_step"]: h for h in history if "_step" in h}
    records = _metrics(metrics)
    steps = {r["iteration"]: r for r in records if "lr" in r}
    evals = {r["iteration"]: r for r in records if "valid_lm_loss" in r}
    assert [s for s, row in logged.items() if "lm_loss" in row] == sorted(steps) == [1, 2, 3, 4]
    assert [s for s, row in logged.items() if "valid_lm_loss" in row] == sorted(evals) == [2, 4]
    for step, row in logged.items():
        if "lm_loss" in row:
            assert row["lm_loss"] == pytest.approx(steps[step]["lm_loss"], rel=1e-6)
            assert row["grad_norm"] == pytest.approx(steps[step]["grad_norm"], rel=1e-6)
        if "valid_lm_loss" in row:
            assert row["valid_lm_loss"] == pytest.approx(evals[step]["valid_lm_loss"], rel=1e-6)


class _FakeRun:
    def __init__(self, calls, **kwargs):
        self.calls, self.name, self.id, self.summary = calls, kwargs.get("name"), "x", {}
        calls.append(("init", kwargs))

    def log(self, values, step):
        self.calls.append(("log", step, dict(values)))

    def finish(self):
        self.calls.append(("finish", dict(self.summary)))


def test_wandb_gets_every_step_and_evaluation(tmp_path, monkeypatch):
    """The exact calls the extension makes, through a stand-in ``wandb`` module: one run with
    the config, each step's metrics and each evaluation's at the iteration, then the summary."""
    import importlib.machinery
    import sys
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: _FakeRun(calls, **kwargs)
    fake.Settings = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    metrics = tmp_path / "m.jsonl"
    done = run_cli(["train", *ARGS, "--wandb-project", "proj", "--wandb-exp-name", "tiny",
                    "--wandb-save-dir", str(tmp_path / "wb"), "--metrics-file", str(metrics)])
    assert done.exit_code == 0, done.output
    init = calls[0][1]
    assert (init["project"], init["name"], init["mode"]) == ("proj", "tiny", "offline")
    assert init["config"]["wandb"]["wandb_project"] == "proj"
    records = _metrics(metrics)
    logs = [c for c in calls if c[0] == "log"]
    train_logs = [c for c in logs if "lm_loss" in c[2]]
    assert [c[1] for c in train_logs] == [r["iteration"] for r in records if "lr" in r] \
        == [1, 2, 3, 4]
    for (_, _, values), r in zip(train_logs, [r for r in records if "lr" in r]):
        assert values["lm_loss"] == pytest.approx(r["lm_loss"], rel=1e-6)
        assert values["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6)
        assert {"lr", "tokens_per_sec", "step_time_s", "memory_mb"} <= set(values)
    assert [c[1] for c in logs if "valid_lm_loss" in c[2]] == [2, 4]
    assert calls[-1][0] == "finish" and calls[-1][1], calls[-1]


def _wandb_records(path: str) -> tuple[list[str], list[dict]]:
    """Record kinds and history rows of an offline run file. The file is W&B's transaction log: a 7-byte header
    (":W&B", magic 0xBEE1, version) then LevelDB-log records in 32 KiB blocks (crc32c, length,
    type FULL/FIRST/MIDDLE/LAST), each a protobuf ``Record`` of wandb_internal.proto."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:8]
    kinds, rows, pos, pending, block = [], [], 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        else:
            kinds.append(f"record type {kind} at byte {pos} of {len(data)}")
            break
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            kinds.append(record.WhichOneof("record_type"))
            if kinds[-1] == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return kinds, rows


@pytest.mark.parametrize("args, message", [
    (["--tensorboard-dir", "{file}/tb"], "is a file, not a directory"),
    (["--tensorboard-log-interval", "0", "--tensorboard-dir", "{dir}"], "must be at least 1"),
    (["--wandb-exp-name", "x"], "needs --wandb-project"),
    (["--wandb-project", "p", "--wandb-save-dir", "{file}"], "is a file, not a directory"),
])
def test_bad_logger_flags_exit_2_before_launch(tmp_path, args, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = [a.format(file=afile, dir=tmp_path / "tb") for a in args]
    done = run_cli(["train", *ARGS, *args])
    assert done.exit_code == 2, done.output
    assert message in done.output
    assert "Traceback" not in done.output
