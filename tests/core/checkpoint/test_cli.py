"""`plugtron checkpoint inspect` and `plugtron evaluate --load`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import load_checkpoint
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import evaluate, setup

from .helpers import ckpt_config, train_resumable

ONE = single_process()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("saved"))
    train_resumable(ckpt_config(save=save, train_iters=3), ONE)
    return save


def test_inspect(saved):
    result = CliRunner().invoke(cli, ["checkpoint", "inspect", saved])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "iteration 3, consumed samples 24" in out
    assert "tp=1" in out and "pp=1" in out and "model: gpt (plugtron-gpt" in out
    assert "etp=" not in out and "ep=" not in out and "expert_parameters" not in out  # dense
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert f"model/{qkv}" in out and "float32   96x32" in out
    assert f"optim/{qkv}/exp_avg" in out
    info = json.loads(CliRunner().invoke(cli, ["checkpoint", "inspect", saved,
                                              "--json"]).output)
    assert info["iteration"] == 3 and info["layout"]["world_size"] == 1
    assert info["config"]["model"]["hidden_size"] == 32
    assert info["tensors"]["model/embedding.word_embeddings.weight"]["shape"] == [104, 32]


def test_inspect_errors(tmp_path):
    result = CliRunner().invoke(cli, ["checkpoint", "inspect", str(tmp_path)])
    assert result.exit_code == 2 and "no complete checkpoint" in result.output


def test_evaluate_reports_valid_loss(saved, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = CliRunner().invoke(cli, ["evaluate", "--load", saved, "--eval-iters", "2",
                                      "--metrics-file", str(metrics), "--no-progress"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 1 and records[0]["iteration"] == 3
    # the same number as evaluating the loaded model by hand
    run = setup(ckpt_config(train_iters=3, eval_iters=2), world=ONE)
    load_checkpoint(run, saved, model_only=True)
    assert records[0]["valid_lm_loss"] == pytest.approx(evaluate(run), rel=1e-6)
    assert f"lm loss {records[0]['valid_lm_loss']:.4f}" in result.output


def test_evaluate_needs_load():
    result = CliRunner().invoke(cli, ["evaluate", "--data", "mock"])
    assert result.exit_code == 2 and "--load" in result.output
