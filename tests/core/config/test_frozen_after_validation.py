"""The config is derived once, by validation, and then fixed: the CLI freezes it in the launcher
and in every rank (core/config_freeze.py), so a plugin cannot change a setting a run was
validated with."""

from __future__ import annotations

import copy
import pickle

import pytest
from plugtron.core.config_freeze import ChangedAfterValidation, freeze, is_frozen
from plugtron.core.training.validate import validate

from tests.utils import tiny_config


def test_validation_derives_what_the_settings_imply():
    config = tiny_config(pp=2, schedule="zbv", vocab_size=500, tp=2, num_layers=4)
    validate(config, world_size=4)
    assert config.parallel.virtual_pipeline_model_parallel_size == 2  # a V shape's two chunks
    assert config.parallel.pipeline_placement == "v"
    assert config.model.padded_vocab_size == 512  # 500 padded to 128 x tp
    assert config.plugins.model == "gpt"  # `auto`, as the selectors chose it


def test_a_frozen_config_refuses_a_change_and_names_the_field():
    config = freeze(tiny_config())
    with pytest.raises(ChangedAfterValidation, match=r"ModelConfig.num_layers is 2 and cannot "
                                                      r"become 7: the config is fixed once it "
                                                      r"is validated"):
        config.model.num_layers = 7
    with pytest.raises(ChangedAfterValidation, match="TrainingConfig.lr"):
        config.training.lr = 1.0
    assert config.model.num_layers == 2 and is_frozen(config.model)


def test_re_deriving_the_same_value_or_filling_an_unset_one_is_allowed():
    config = freeze(tiny_config())
    config.model.num_layers = 2  # a rank deriving the same value again
    assert config.model.padded_vocab_size is None
    config.model.padded_vocab_size = 512  # what only the rank knows: filled once
    with pytest.raises(ChangedAfterValidation):
        config.model.padded_vocab_size = 1024


def test_plugin_sections_are_frozen_too():
    config = freeze(tiny_config())
    with pytest.raises(ChangedAfterValidation, match="adam_beta2"):
        config.adam.adam_beta2 = 0.5


def test_a_copy_is_its_makers_to_change():
    config = freeze(tiny_config())
    for other in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert not is_frozen(other) and not is_frozen(other.model)
        other.model.num_layers = 9
        assert other.to_dict()["model"]["num_layers"] == 9
    assert config.model.num_layers == 2
