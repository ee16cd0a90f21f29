"""The save directory under faults: two runs, a crashed re-save, an async save cut off, a
corrupt newest checkpoint, another run's newer checkpoints, leftovers of crashed saves."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket

from plugtron.core.checkpoint import CheckpointReader, layout

from .mutate import refresh_metadata
from .test_ranks_and_signals import _start, _steps, _wait_training
from .tools import PYTHON, finish, kill_group, run_cli, start_cli, tiny_flags, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(save, iters, *extra):
    return run_cli(["train", *tiny_flags(train_iters=iters), "--save", save, *extra])


def _loaded(out: str) -> str | None:
    for line in out.splitlines():
        if line.startswith("loaded checkpoint "):
            return os.path.basename(line.split()[2])
    return None


def test_second_run_is_refused_and_a_dead_holder_is_taken_over(tmp_path):
    save = str(tmp_path / "save")
    first, metrics = _start(tmp_path, "--save", save, "--save-interval", "2", nproc=1)
    try:
        _wait_training(first, metrics)
        assert wait_for(lambda: os.path.isfile(os.path.join(save, "latest")), 60)
        second = _train(save, 2)
        assert second.rc == 2, second.out
        assert f"pid {first.pid} on host {socket.gethostname()}" in second.out, second.out
        # What the first run kept: the refused run touched none of its checkpoints.
        kept = layout.read_latest(save)
        CheckpointReader(os.path.join(save, kept)).verify_all()
    finally:
        os.kill(first.pid, signal.SIGKILL)  # leaves a stale lock file behind
        finish(first, 10)
    third = _train(save, 2)
    assert third.rc == 0, third.out


def _two_iterations(saved_run, save):
    """A save directory with iterations 1 and 2 (1: a copy of 2 with its number changed)."""
    shutil.copytree(saved_run[0], save)
    shutil.copytree(os.path.join(save, "iter_0000002"), os.path.join(save, "iter_0000001"))
    refresh_metadata(os.path.join(save, "iter_0000001"),
                     lambda m: m.__setitem__("iteration", 1))


def test_resave_killed_between_renames_every_reader_loads_it(tmp_path, saved_run):
    """A run re-saving iteration 2 (a rerun into the same directory) is killed -9 inside the
    commit, with the atomic exchange and with the two-rename fallback: `inspect`, `evaluate`,
    `convert export-hf` and `train --load` (driver process) then all load iteration 2, never
    the older iteration 1."""
    delay = {"PLUGTRON_CHECKPOINT_TEST_FILE_DELAY": "1.5"}
    runs = {}
    for how, env, inside in [
            ("exchange", delay, lambda s: os.path.isfile(
                os.path.join(s, ".tmp-iter_0000002", "metadata.json"))),
            ("renames", {**delay, "PLUGTRON_CHECKPOINT_TEST_NO_EXCHANGE": "1"},
             lambda s: any(".old-" in n for n in os.listdir(s)))]:
        save = str(tmp_path / how)
        _two_iterations(saved_run, save)
        proc = start_cli(["train", *tiny_flags(train_iters=2), "--save", save], env=env)
        runs[how] = (save, proc, inside)
    for how, (save, proc, inside) in runs.items():
        try:
            assert wait_for(lambda: inside(save) or proc.poll() is not None, 60), how
            assert proc.poll() is None, finish(proc).out
        finally:
            kill_group(proc.pid)
            finish(proc, 10)
        assert layout.read_latest(save) == "iter_0000002"
    moved = [n for n in os.listdir(runs["renames"][0]) if ".old-" in n]
    assert moved and not os.path.exists(os.path.join(runs["renames"][0], "iter_0000002"))
    assert os.path.isfile(os.path.join(runs["exchange"][0], "iter_0000002", "metadata.json"))
    cases = []
    for how, (save, _, _) in runs.items():
        out = os.path.join(str(tmp_path), how + "-hf")
        for name, args in [("inspect", ["checkpoint", "inspect", save]),
                           ("evaluate", ["evaluate", "--load", save, "--eval-iters", "1",
                                         "--no-progress"]),
                           ("export", ["convert", "export-hf", save, out]),
                           ("train", ["train", *tiny_flags(train_iters=3), "--load", save])]:
            cases.append({"name": f"{how}/{name}", "args": args})
    results = _drive_plain(str(tmp_path), cases)
    for r in results:
        assert r["rc"] == 0 and not r["traceback"], r
        if r["name"].split("/")[1] != "export":
            assert "iteration 2" in r["output"], r
        assert "iteration 1" not in r["output"], r
        if r["name"].startswith("renames"):
            assert "loading iter_0000002.old-" in r["output"], r


def _drive_plain(root, cases):
    spec, report = os.path.join(root, "cases.json"), os.path.join(root, "report.json")
    with open(spec, "w") as f:
        json.dump({"forbidden": [], "cases": cases}, f)
    done = finish(start_cli([], argv=[PYTHON, "-m", "tests.reliability.hostile_driver", spec,
                                      report], cwd=REPO), 150)
    assert done.rc == 0 and not done.timed_out, done.out
    with open(report) as f:
        return json.load(f)[:-1]


def test_crashed_resave_keeps_latest_loadable(tmp_path, saved_run):
    save = str(tmp_path / "save")
    shutil.copytree(saved_run[0], save)
    # What a kill between the two renames of a re-save leaves: the old copy moved aside.
    os.rename(os.path.join(save, "iter_0000002"), os.path.join(save, "iter_0000002.old-4242"))
    done = _train(save, 3, "--load", save)
    assert done.rc == 0, done.out
    assert _loaded(done.out) == "iter_0000002", done.out
    assert not any(".old-" in n for n in os.listdir(save))


def test_crashed_save_leftovers_removed_at_next_start(tmp_path, saved_run):
    save = str(tmp_path / "save")
    shutil.copytree(saved_run[0], save)
    os.makedirs(os.path.join(save, ".tmp-iter_0000009"))
    done = _train(save, 5, "--load", save, "--exit-interval", "3")
    assert done.rc == 0 and not os.path.exists(os.path.join(save, ".tmp-iter_0000009"))
    # --exit-interval 3 (of 5 iterations): a clean stop after iteration 3, one line, saved.
    stops = [line for line in done.out.splitlines() if line.startswith("stopped after")]
    assert stops == [f"stopped after iteration 3: --exit-interval 3; checkpoint saved in {save}"]
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000003"


def test_async_save_committed_when_written(tmp_path):
    save = str(tmp_path / "save")
    # The write (4 files, each followed by a 0.05 s test delay, so it overlaps steps) must be
    # far shorter than the 200 steps to the next save: one thread runs the tiny model's step in
    # about 8 ms, and with 0.3 s a file the write once outlasted 100 steps (CI-like run, one
    # OpenMP thread). A loaded machine slows the steps, not the sleeps: the margin only grows.
    proc, metrics = _start(tmp_path, "--save", save, "--save-interval", "200", "--async-save",
                           nproc=1, env={"PLUGTRON_CHECKPOINT_TEST_FILE_DELAY": "0.05"})
    try:
        # 200 steps plus the write: bounded generously, as another test worker may share the
        # cores; what is checked is the step count at the commit, not the time. The commit is
        # `latest` naming the checkpoint: the directory is renamed into place just before, and
        # a kill between the two (as a wait on the directory once did) leaves no `latest`.
        committed = wait_for(lambda: layout.read_latest(save) == "iter_0000200", 150)
        steps = _steps(metrics)
        assert committed and proc.poll() is None
        assert steps < 400, f"committed only at the next save (step {steps})"
    finally:
        kill_group(proc.pid)  # a crash after the write: the checkpoint must stay
        finish(proc, 10)
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000200"


def test_corrupt_newest_falls_back_with_a_warning(tmp_path):
    save = str(tmp_path / "save")
    assert _train(save, 4, "--save-interval", "2").rc == 0
    model = os.path.join(save, "iter_0000004", "model_rank_00000.safetensors")
    with open(model, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\xfe\xfd\xfc\xfb")
    done = _train(save, 5, "--load", save, "--exit-interval", "3")
    assert done.rc == 0, done.out
    assert "warning: skipping checkpoint" in done.out and "iter_0000004" in done.out
    assert _loaded(done.out) == "iter_0000002"
    explicit = run_cli(["train", *tiny_flags(train_iters=5), "--load",
                        os.path.join(save, "iter_0000004")])
    assert explicit.rc == 2 and "CRC" in explicit.out, explicit.out


def test_another_runs_newer_checkpoints_are_not_resumed(tmp_path, saved_run):
    save = str(tmp_path / "save")
    assert _train(save, 4).rc == 0  # run A: iter_0000004
    os.remove(os.path.join(save, "latest"))
    shutil.rmtree(os.path.join(save, "iter_0000004"))
    shutil.copytree(saved_run[0] + "/iter_0000002", os.path.join(save, "iter_0000002"))
    assert _train(str(tmp_path / "a"), 6, "--save-interval", "6").rc == 0
    shutil.copytree(str(tmp_path / "a" / "iter_0000006"), os.path.join(save, "iter_0000006"))
    # Run B starts from scratch into the directory holding run A's iteration 6.
    assert _train(save, 3, "--save-interval", "3").rc == 0
    done = _train(save, 4, "--load", save)
    assert done.rc == 0, done.out
    assert _loaded(done.out) == "iter_0000003", done.out


def test_load_resumes_even_when_save_holds_a_newer_checkpoint(tmp_path):
    """Megatron's rule: --load is what resumes; --save (another directory) with a newer
    checkpoint is said, not loaded."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    assert _train(first, 2).rc == 0  # first/iter_0000002
    assert _train(second, 4, "--load", first).rc == 0  # second/iter_0000004
    done = _train(second, 6, "--load", first)
    assert done.rc == 0, done.out
    assert _loaded(done.out) == "iter_0000002", done.out
    assert f"note: --save {second} holds iteration 4, newer than the loaded 2" in done.out


def _pretrain(save, iters, metrics):
    argv = [PYTHON, "-m", "tests.reliability.pretrain_driver", save, str(iters), metrics]
    return start_cli([], argv=argv, cwd=REPO)


def test_pretrain_from_python_holds_the_save_lock(tmp_path):
    """Two Python users of pretrain() on one --save: the lock is the training mechanism's,
    not only the CLI's."""
    save, metrics = str(tmp_path / "save"), str(tmp_path / "m.jsonl")
    first = _pretrain(save, 100000, metrics)
    try:
        _wait_training(first, metrics)
        second = finish(_pretrain(save, 2, str(tmp_path / "m2.jsonl")))
        assert second.rc == 2, second.out
        assert f"in use by pid {first.pid} on host {socket.gethostname()}" in second.out
        assert "Traceback" not in second.out
    finally:
        os.kill(first.pid, signal.SIGKILL)
        finish(first, 10)
    third = finish(_pretrain(save, 2, str(tmp_path / "m3.jsonl")))
    assert third.rc == 0, third.out
    assert os.path.isdir(os.path.join(save, "iter_0000002"))
