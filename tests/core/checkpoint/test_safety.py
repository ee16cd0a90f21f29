"""Damaged checkpoints give a clear CheckpointError naming the file; a process killed while
writing leaves the previous checkpoint loadable and `latest` pointing at it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from plugtron.core.checkpoint import CheckpointReader, layout, load_checkpoint
from plugtron.core.checkpoint.writer import TEST_DELAY_ENV
from plugtron.core.errors import CheckpointError
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup

from .helpers import ckpt_config, train_resumable

ONE = single_process()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("saved"))
    train_resumable(ckpt_config(save=save, train_iters=2), ONE)
    return os.path.join(save, "iter_0000002")


@pytest.fixture(scope="module")
def run():
    return setup(ckpt_config(train_iters=2), world=ONE)


def _copy(saved, tmp_path) -> str:
    target = str(tmp_path / "iter_0000002")
    shutil.copytree(saved, target)
    return target


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _damage_cases():
    # (file, what to do); offsets are relative: -1 from the end, 9 in the safetensors header
    return [("model_rank_00000.safetensors", "flip-end"),
            ("model_rank_00000.safetensors", "flip-header"),
            ("optim_rank_00000.safetensors", "truncate"),
            ("rank_00000.json", "flip-middle"),
            ("rank_00000.json", "delete"),
            ("metadata.json", "flip-middle"),
            ("metadata.json", "truncate")]


@pytest.mark.parametrize("name,damage", _damage_cases())
def test_damaged_file_is_named(saved, run, tmp_path, name, damage):
    directory = _copy(saved, tmp_path)
    path = os.path.join(directory, name)
    size = os.path.getsize(path)
    if damage == "flip-end":
        _flip(path, size - 1)
    elif damage == "flip-header":
        _flip(path, 9)
    elif damage == "flip-middle":
        # a digit or letter inside the JSON: still valid JSON, different content
        with open(path, "rb") as f:
            data = f.read()
        at = data.index(b'"iteration"' if name == "metadata.json" else b'"rank"')
        at = data.index(b":", at) + 2
        _flip(path, at)
    elif damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "delete":
        os.remove(path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(run, directory)
    assert name in str(err.value)


def test_intact_copy_loads(saved, run, tmp_path):
    load_checkpoint(run, _copy(saved, tmp_path))
    assert run.state.iteration == 2


KILLED_RUN = """
import sys
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import pretrain
from tests.utils import tiny_config
pretrain(tiny_config(train_iters=4, save=sys.argv[1], save_interval=2), world=single_process())
"""


def test_sigkill_while_writing_keeps_previous_checkpoint(tmp_path):
    save = str(tmp_path / "save")
    env = {**os.environ, TEST_DELAY_ENV: "0.5", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, save], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = os.path.join(save, layout.tmp_dirname(4))
    deadline = time.monotonic() + 120
    try:
        # Wait until iteration 2 is committed and iteration 4 has started writing files.
        while time.monotonic() < deadline and proc.poll() is None:
            if layout.read_latest(save) and os.path.isdir(partial) and os.listdir(partial):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed mid-save"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert layout.read_latest(save) == "iter_0000002"
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    assert os.path.isdir(partial)  # the interrupted write, never renamed into place
    assert CheckpointReader(save).iteration == 2
    losses, _ = train_resumable(ckpt_config(load=save, save=save, train_iters=3), ONE)
    assert sorted(losses) == [3]
    assert layout.read_latest(save) == "iter_0000003"
    assert not os.path.exists(partial)  # the next commit cleaned it up


def test_failed_background_write_is_reported_and_commits_nothing(tmp_path, monkeypatch):
    from plugtron.core.checkpoint import checkpointer, writer

    run = setup(ckpt_config(train_iters=2, save=str(tmp_path)), world=ONE)
    saver = checkpointer(run)
    saver.save(1)
    assert layout.read_latest(str(tmp_path)) == "iter_0000001"

    def broken(directory, snap):
        raise OSError("No space left on device")

    monkeypatch.setattr(writer, "write_rank_files", broken)
    saver.save(2, async_save=True)  # returns once the snapshot is taken
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint"):
        saver.wait()
    assert layout.read_latest(str(tmp_path)) == "iter_0000001"
    assert not os.path.exists(tmp_path / "iter_0000002")
    assert CheckpointReader(str(tmp_path)).iteration == 1
