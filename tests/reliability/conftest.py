"""Shared fixtures of the fault tests: one small checkpoint written by a real `plugtron train`
process, and a Hugging Face directory exported from it."""

from __future__ import annotations

import os

import pytest

from .tools import run_cli, tiny_flags


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory):
    """(save dir, checkpoint dir) of a 2-iteration run of the tiny model."""
    save = str(tmp_path_factory.mktemp("saved") / "ckpt")
    done = run_cli(["train", *tiny_flags(train_iters=2), "--save", save])
    assert done.rc == 0, done.out
    return save, os.path.join(save, "iter_0000002")


@pytest.fixture(scope="session")
def hf_dir(saved_run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf") / "model")
    done = run_cli(["convert", "export-hf", saved_run[1], out])
    assert done.rc == 0, done.out
    return out
