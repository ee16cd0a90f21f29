"""docs/writing-plugins.md, executed: its package is copied out of the page, pip-installed, and
the model it builds trains on one process with --hidden-size 30 (no attention rules in the
core), reports its own main loss key, adds a loss from inside the model, and under tp 2 x pp 2
(4 gloo ranks) gives the single-process losses and grad norms within relative 1e-5 (fp32).
Its tied embedding, held by the first and last stage, is written once and survives a save and
resume under pp 2; ``plugtron.api.load_model`` reads the pp 2 checkpoint into one process."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from plugtron.core.parallel.distributed import single_process

from tests.distributed.harness import DistributedPool
from tests.doc_packages import doc_files, install_doc_package
from tests.utils import tiny_config, train_in_process

DOC = pathlib.Path(__file__).parents[2] / "docs" / "writing-plugins.md"
FLAGS = {"model": "shiftmlp", "num_layers": 4, "hidden_size": 32, "activation_penalty": 0.05,
         "global_batch_size": 8, "micro_batch_size": 2, "train_iters": 4}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tutorial")
    package, site = root / "plugtron-shiftmlp", root / "site"
    install_doc_package(DOC, package, site)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield site
    sys.path.remove(str(site))
    for module in [m for m in sys.modules if m == "shiftmlp"]:
        del sys.modules[module]
    importlib.invalidate_caches()


def test_the_page_has_the_package_and_the_plugin_is_short():
    files = doc_files(DOC.read_text())
    assert set(files) == {"pyproject.toml", "shiftmlp.py"}
    code = [line for line in files["shiftmlp.py"].splitlines()
            if line.strip() and not line.strip().startswith("#")]
    assert len(code) < 100


def test_trains_with_hidden_30_and_its_own_loss_key(installed):
    records, run = train_in_process(tiny_config(**{**FLAGS, "hidden_size": 30}),
                                    world=single_process())
    assert run.config.shift_mlp.expansion == 4  # the plugin's typed section
    assert "loss" in records[0] and "lm_loss" not in records[0]
    assert records[0]["activation_penalty"] > 0
    assert records[-1]["loss"] < records[0]["loss"]


def test_cli_shows_the_options_and_refuses_sequence_parallel(installed):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), *sys.path])}
    cli = [sys.executable, "-m", "plugtron.cli.main", "train"]
    help_text = subprocess.run([*cli, "--model", "shiftmlp", "--help"], env=env,
                               capture_output=True, text=True).stdout
    assert "ShiftMLP model (plugtron-shiftmlp 0.1.0)" in help_text
    assert "--shift-mlp-expansion" in help_text
    bad = subprocess.run([*cli, "--model", "shiftmlp", "--nproc-per-node", "2", "--tp", "2",
                          "--sequence-parallel"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "--sequence-parallel is refused" in bad.stderr
    assert "Traceback" not in bad.stderr


def _run(rank, world_size, flags, site, save=None, load=None):
    if site not in sys.path:
        sys.path.insert(0, site)
    extra = {"save": save, "save_interval": 2} if save else {}
    if load:
        extra["load"] = load
    from plugtron.core import checkpoint
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.training import loop as training

    from tests.utils import StepRecorder

    recorder = StepRecorder()
    run = training.setup(tiny_config(**flags, **extra), extra_plugins=[recorder])
    checkpoint.load_if_requested(run)
    training.train(run, MetricsLogger(run.config, rank=1))
    records = recorder.records
    return {"pp_rank": run.parallel.pp_rank,
            "losses": [r.get("loss") for r in records],
            "penalty": [r.get("activation_penalty") for r in records],
            "grad_norms": [r["grad_norm"] for r in records]}


@pytest.fixture(scope="module")
def reference(installed):
    records, _ = train_in_process(tiny_config(**FLAGS), world=single_process())
    return records


@pytest.fixture(scope="module")
def pool(installed):
    with DistributedPool(4, timeout=300) as p:  # started after the install: children see it
        yield p


def test_tp2_pp2_matches_one_process(pool, installed, reference):
    ranks = pool.run(_run, {**FLAGS, "tp": 2, "pp": 2}, str(installed))
    for r in ranks:
        assert r["losses"] == pytest.approx([x["loss"] for x in reference], rel=1e-5)
        assert r["grad_norms"] == pytest.approx([x["grad_norm"] for x in reference], rel=1e-5)
        assert r["penalty"] == pytest.approx([x["activation_penalty"] for x in reference],
                                             rel=1e-5)


def test_tied_parameter_survives_save_and_resume_under_pp2(pool, installed, reference,
                                                           tmp_path):
    flags = {**FLAGS, "pp": 2}
    save = str(tmp_path / "ck")
    continuous = pool.run(_run, flags, str(installed), save=save)[0]["losses"]
    manifest = json.dumps(sorted(os.listdir(os.path.join(save, "iter_0000002"))))
    resumed = pool.run(_run, flags, str(installed), load=os.path.join(save, "iter_0000002"),
                       save=str(tmp_path / "again"))[0]["losses"]
    assert resumed == pytest.approx(continuous[2:], rel=1e-6)
    from plugtron.core.checkpoint import CheckpointReader

    names = CheckpointReader(save).names("model/")
    assert "embedding.weight" in names and "head.weight" not in names, manifest

    from plugtron.api import load_model

    model = load_model(save)
    tokens = torch.randint(0, 100, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 100) and logits.dtype == torch.float32
