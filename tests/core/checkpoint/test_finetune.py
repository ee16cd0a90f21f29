"""``--pretrained-checkpoint`` with ``--finetune``: the base's model weights only, iteration 0,
a fresh optimizer; with LoRA the fine-tune's checkpoints hold the adapters (and their optimizer
state) and name the base instead of holding it again, and a resumed fine-tune is bitwise the
uninterrupted one; resuming without the base, or from another base, is refused naming it;
``load_model`` finds the base at its recorded path. One process, in this process."""

from __future__ import annotations

import pytest
import torch
from plugtron.api import CheckpointError, ConfigError, load_model
from plugtron.core import checkpoint
from plugtron.core.checkpoint import CheckpointReader
from plugtron.core.interchange.hf_export import export_hf
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import pretrain, setup, train
from plugtron.core.training.validate import validate
from plugtron.testing.checkpoints import read_checkpoint

from tests.utils import StepRecorder, tiny_config

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two base checkpoints: trained 2 iterations from seeds 1234 and 7."""
    root = tmp_path_factory.mktemp("bases")
    for name, seed in (("base", 1234), ("other", 7)):
        pretrain(tiny_config(train_iters=2, seed=seed, save=str(root / name)),
                 world=single_process())
    return root


def _finetune(bases, stop_at=None, **flags):
    """A LoRA fine-tune of 4 iterations from ``bases/base``; returns (records, params, run)."""
    config = tiny_config(**{"train_iters": 4, "pretrained_checkpoint": str(bases / "base"),
                            "finetune": True, **LORA, **flags})
    recorder = StepRecorder()
    run = setup(config, extra_plugins=[recorder], world=single_process())
    if stop_at is not None:
        run.config.training.train_iters = stop_at
    try:
        checkpoint.load_if_requested(run)
        train(run, MetricsLogger(config, rank=1))
    finally:
        checkpoint.close(run)
    (chunk,) = run.model_chunks
    params = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
    return recorder.records, params, run


def test_a_fine_tune_starts_from_the_base_weights_at_iteration_zero(bases):
    saved = read_checkpoint(str(bases / "base"))["tensors"]
    config = tiny_config(train_iters=4, pretrained_checkpoint=str(bases / "base"),
                         finetune=True, **LORA)
    run = setup(config, world=single_process())
    checkpoint.load_if_requested(run)
    assert run.state.iteration == 0 and run.base_checkpoint["iteration"] == 2
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(dict(run.model_chunks[0].module.named_parameters())[name],
                       saved[f"model/{name}"])
    assert run.optimizer.sharded_state_dict()[
        f"{name.rsplit('.', 1)[0]}.adapter.linear_in.weight"] == {}  # fresh: no state yet


def test_the_checkpoint_holds_the_adapters_and_names_its_base_and_resumes_bitwise(bases,
                                                                                  tmp_path):
    whole, final, _ = _finetune(bases)
    save = str(tmp_path / "ft")
    _finetune(bases, stop_at=2, save=save)
    reader = CheckpointReader(save)
    stored = [n for n in reader.tensors if n.startswith("model/")]
    assert stored and all(".adapter." in n for n in stored), stored
    assert reader.metadata["base_checkpoint"]["iteration"] == 2
    reader.close()
    rest, resumed, _ = _finetune(bases, save=save, load=save)
    assert [r["lm_loss"] for r in rest] == [r["lm_loss"] for r in whole[2:]]
    assert all(torch.equal(resumed[n], final[n]) for n in final)


def test_resuming_needs_the_same_base(bases, tmp_path):
    save = str(tmp_path / "ft")
    _finetune(bases, stop_at=2, save=save)
    with pytest.raises(CheckpointError, match="not the base this fine-tune was trained from"):
        _finetune(bases, save=save, load=save, pretrained_checkpoint=str(bases / "other"))
    config = tiny_config(train_iters=4, load=save, **LORA)
    run = setup(config, world=single_process())
    with pytest.raises(CheckpointError, match="without its base model: give "
                                              "--pretrained-checkpoint"):
        checkpoint.load_if_requested(run)
    model = load_model(save)  # weights only: the recorded base
    assert any(".adapter." in n for n, _ in model.module.named_parameters())


def test_bad_fine_tune_settings_are_refused_before_launch(bases):
    with pytest.raises(ConfigError, match="--finetune needs --pretrained-checkpoint"):
        validate(tiny_config(finetune=True), 1)
    with pytest.raises(ConfigError, match="add --finetune"):
        validate(tiny_config(pretrained_checkpoint=str(bases / "base")), 1)


def test_a_base_of_other_shapes_is_refused(bases):
    config = tiny_config(train_iters=1, hidden_size=64, pretrained_checkpoint=str(bases / "base"),
                         finetune=True, **LORA)
    run = setup(config, world=single_process())
    with pytest.raises(CheckpointError, match="hidden-size"):
        checkpoint.load_if_requested(run)


def test_the_cli_refuses_finetune_without_a_base_with_exit_2():
    from click.testing import CliRunner
    from plugtron.cli.main import cli

    result = CliRunner().invoke(cli, ["train", "--finetune", "--data", "mock",
                                      "--train-iters", "1"])
    assert result.exit_code == 2, result.output
    assert "--finetune needs --pretrained-checkpoint" in result.output


def test_export_hf_merges_a_fine_tunes_adapters_into_its_base(bases, tmp_path, monkeypatch):
    """A checkpoint without its base exports as the whole plain model: the base's tensors
    with the adapters merged in, computing what the fine-tuned model does."""
    monkeypatch.setenv("PLUGTRON_HF_CACHE", str(tmp_path / "cache"))
    save = str(tmp_path / "ft")
    _finetune(bases, stop_at=2, save=save)
    export_hf(save, str(tmp_path / "hf"))
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load_model(str(tmp_path / "hf"))(tokens), load_model(save)(tokens),
                               rtol=1e-5, atol=1e-5)
