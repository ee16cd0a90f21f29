"""Selectors answer ``auto`` and Megatron-style flags with a driver's name; the core maps no
flag to a plugin (contract 3). The built-in ``megatron`` selector gives Megatron's defaults,
and a third party's selector answers a flag of its own the same way."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from plugtron.api import ConfigError, TrainConfig, selected_driver
from plugtron.cli.main import cli
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.plugins.selection import FIELDS, resolve, selected_drivers
from plugtron.core.training.validate import validate

from tests.fake_plugins import install_fake_distribution, remove_path
from tests.utils import tiny_config


@pytest.mark.parametrize("flags,role,want", [
    ({}, "schedule", "no-pipelining"),
    ({"pp": 2}, "schedule", "1f1b"),
    ({"pp": 2, "vp": 2}, "schedule", "interleaved-1f1b"),
    ({"pp": 2, "schedule": "gpipe"}, "schedule", "gpipe"),
    ({}, "optimizer", "adam"),
    ({"use-distributed-optimizer": True}, "optimizer", "distributed-adam"),
    ({"data-parallel-sharding-strategy": "optim"}, "optimizer", "distributed-adam"),
    ({}, "data_parallel", "ddp"),
    ({"use-torch-fsdp2": True}, "data_parallel", "fsdp2"),
    ({"data-parallel-sharding-strategy": "optim_grads_params"}, "data_parallel", "fsdp2"),
])
def test_hook_plugtron_select(flags, role, want):
    assert selected_drivers(tiny_config(**flags))[role] == want


def test_an_optimizer_without_a_sharded_mode_is_refused_by_the_selector():
    config = tiny_config(optimizer="sgd", use_distributed_optimizer=True)
    assert selected_drivers(config)["optimizer"] == "sgd"
    with pytest.raises(ConfigError, match="--use-distributed-optimizer shards the optimizer's "
                                          "state over data parallelism, which --optimizer sgd "
                                          "does not offer"):
        validate(config, 1)


def test_an_optimizer_with_a_layer_wise_mode_keeps_its_name():
    config = tiny_config(optimizer="muon", use_distributed_optimizer=True)
    assert selected_drivers(config)["optimizer"] == "muon"
    validate(config, 2)


def test_a_checkpoint_config_from_before_selects_the_same_drivers():
    saved = tiny_config().to_dict()
    saved.pop("megatron")
    saved["parallel"]["use_torch_fsdp2"] = True  # where contract 2 wrote it
    saved["parallel"]["use_distributed_optimizer"] = False
    config = config_from_dict(saved)
    assert config.megatron.use_torch_fsdp2 is True
    assert selected_drivers(config)["data_parallel"] == "fsdp2"
    assert hasattr(config, "fsdp2")  # and with it the wrapper's own section


THIRD_PARTY = '''
from dataclasses import dataclass

from plugtron.api import ConfigSection, load_plugin, opt


@dataclass
class OwnFlags:
    use_my_fsdp: bool = opt(False, "--use-my-fsdp", "Use my wrapper.", is_flag=True)


class MySelector:
    @staticmethod
    def plugtron_config_sections():
        return [ConfigSection("my_selection", OwnFlags)]

    @staticmethod
    def plugtron_select(role, config):
        if role == "data_parallel" and config.my_selection.use_my_fsdp:
            return "my-fsdp"
        return None


class MyFSDP:
    """ddp under another name (what it does is not the point here)."""

    def __getattr__(self, name):
        return getattr(load_plugin("data_parallel", "ddp")(), name)
'''


@pytest.fixture
def third_party(tmp_path):
    install_fake_distribution(tmp_path, "plugtron-my-fsdp", "0.1.0",
                              {"plugtron.selectors": {"mine": "my_fsdp:MySelector"},
                               "plugtron.data_parallel": {"my-fsdp": "my_fsdp:MyFSDP"}},
                              {"my_fsdp": THIRD_PARTY})
    yield
    remove_path(tmp_path)


def test_a_third_partys_selector_answers_its_own_flag(third_party):
    assert selected_drivers(tiny_config(use_my_fsdp=True))["data_parallel"] == "my-fsdp"
    assert selected_drivers(tiny_config())["data_parallel"] == "ddp"
    # two selectors that answer differently: refused, naming both
    with pytest.raises(ConfigError, match="the data_parallel is ambiguous: .*'megatron'.*"
                                          "'fsdp2'.*'mine'.*'my-fsdp'"):
        selected_drivers(tiny_config(use_my_fsdp=True, use_torch_fsdp2=True))
    result = CliRunner().invoke(cli, ["train", "--help"])
    assert "--use-my-fsdp" in result.output


@pytest.mark.parametrize("role,want", [
    ("model", "gpt"), ("optimizer", "adam"), ("layer_backend", "local"), ("dataset", "text")])
def test_every_default_is_auto_and_a_selector_answers_it(role, want):
    config = TrainConfig()
    assert getattr(config.plugins, FIELDS[role]) == "auto"  # the core names no plugin
    assert selected_driver(config, role) == want


def test_auto_that_no_selector_answers_names_the_flag_and_the_choices():
    with pytest.raises(ConfigError, match=r"--model auto: no installed selector .* give "
                                          r"--model NAME .*gpt"):
        resolve("model", TrainConfig(), selectors=[])


def test_validation_writes_the_chosen_plugins_into_the_config():
    config = tiny_config(model="auto", layer_backend="auto", data="auto", data_path=["x"])
    validate(config, world_size=1)
    assert (config.plugins.model, config.plugins.layer_backend, config.plugins.data) == \
        ("gpt", "local", "text")  # what a checkpoint of this run records


OWN_DEFAULT = '''
class MyDefaults:
    @staticmethod
    def plugtron_select(role, config):
        if role == "optimizer" and config.plugins.optimizer == "auto":
            return "sgd"  # chosen, not a fallback: it wins over the built-in default
        return None
'''


def test_a_third_partys_choice_wins_over_the_built_in_default(tmp_path):
    install_fake_distribution(tmp_path, "plugtron-my-defaults", "0.1.0",
                              {"plugtron.selectors": {"my-defaults": "my_defaults:MyDefaults"}},
                              {"my_defaults": OWN_DEFAULT})
    try:
        assert selected_driver(tiny_config(), "optimizer") == "sgd"
        assert selected_driver(tiny_config(optimizer="adam"), "optimizer") == "adam"
    finally:
        remove_path(tmp_path)
