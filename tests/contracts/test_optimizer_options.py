"""Optimizers own their options (contract 3): Adam's betas and eps in section ``adam``, SGD's
momentum in ``sgd``; they are flags only when that optimizer is selected, and a checkpoint's
config written before (the fields in ``training``) still gives their values."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.plugins.options import config_from_dict

from tests.utils import tiny_config


def test_adams_options_are_adams():
    config = tiny_config(adam_beta1=0.8, adam_eps=1e-6)
    assert (config.adam.adam_beta1, config.adam.adam_beta2, config.adam.adam_eps) == \
        (0.8, 0.95, 1e-6)
    assert not hasattr(config.training, "adam_beta1")
    assert tiny_config(optimizer="distributed-adam", adam_beta2=0.9).adam.adam_beta2 == 0.9
    assert tiny_config(optimizer="sgd", sgd_momentum=0.5).sgd.sgd_momentum == 0.5


def test_the_betas_reach_the_torch_optimizer():
    from plugtron.core.parallel.distributed import single_process
    from plugtron.core.training.loop import setup

    run = setup(tiny_config(adam_beta1=0.7, adam_beta2=0.8, adam_eps=1e-5),
                world=single_process())
    group = run.optimizer.inner.param_groups[0]
    assert group["betas"] == (0.7, 0.8) and group["eps"] == 1e-5


def test_an_option_of_an_optimizer_not_selected_is_refused():
    result = CliRunner().invoke(cli, ["train", "--optimizer", "sgd", "--adam-beta1", "0.8",
                                      "--data", "mock", "--train-iters", "1"])
    assert result.exit_code == 2
    assert "--adam-beta1" in result.output and "adam" in result.output


@pytest.mark.parametrize("optimizer,field,value", [("adam", "adam_beta2", 0.99),
                                                   ("sgd", "sgd_momentum", 0.3)])
def test_a_checkpoint_config_from_before_keeps_its_values(optimizer, field, value):
    saved = tiny_config(optimizer=optimizer).to_dict()
    section = saved.pop("adam" if optimizer == "adam" else "sgd")
    saved["training"][field] = value  # where contract 2 wrote it
    assert field in section
    config = config_from_dict(saved)
    assert getattr(getattr(config, "adam" if optimizer == "adam" else "sgd"), field) == value
