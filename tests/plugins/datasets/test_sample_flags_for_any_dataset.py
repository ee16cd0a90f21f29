"""Megatron's sample flags (--reset-position-ids, --reset-attention-mask, --eod-mask-loss) are
part of the public dataset contract: a third party's dataset that declares
``plugtron.api.SAMPLE_SECTION`` and builds its samples with ``sample_from_window`` gets them,
flags, validation and all, as the built-in datasets do."""

from __future__ import annotations

import pytest
import torch
from plugtron.api import ConfigError
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.training.validate import validate

from tests.fake_plugins import fake_distribution

EOD = 0
DATASET = '''
import numpy as np
from plugtron.api import (SAMPLE_SECTION, hookimpl, sample_from_window,
                          validate_sample_options)

EOD = 0


class Windows:
    def __init__(self, n, seq, options):
        self.n, self.seq, self.options = n, seq, options

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        # documents of 3 tokens, each ended by EOD: 5 6 0 5 6 0 ...
        window = np.array([(5, 6, EOD)[(i + j) % 3] for j in range(self.seq + 1)])
        return sample_from_window(window, self.options, eod=EOD)


class ThirdPartyData:
    @hookimpl
    def plugtron_config_sections(self):
        return [SAMPLE_SECTION]

    @hookimpl
    def plugtron_validate(self, config):
        validate_sample_options(config)

    @hookimpl
    def dataset_vocab_size(self, config):
        return 8

    @hookimpl
    def dataset_provider(self, config, split_sizes):
        return [Windows(n, config.model.seq_length, config.samples) if n else None
                for n in split_sizes]
'''


@pytest.fixture
def third_party_data(tmp_path):
    with fake_distribution(tmp_path, "plugtron-windows", "plugtron.datasets",
                           "windows=windows_data:ThirdPartyData", "windows_data", DATASET):
        yield


def _config(**flags):
    return config_from_flags({"data": "windows", "vocab-size": 8, "seq-length": 8,
                              "num-layers": 2, "hidden-size": 16, "num-attention-heads": 2,
                              **flags}, "test")


def test_a_third_party_dataset_gets_the_sample_flags(third_party_data):
    from plugtron.api import load_plugin

    config = _config(**{"eod-mask-loss": True, "reset-position-ids": True,
                        "reset-attention-mask": True})
    assert config.samples.eod_mask_loss and config.samples.reset_position_ids
    dataset = load_plugin("dataset", "windows")().dataset_provider(config, (2, 0, 0))[0]
    sample = dataset[0]  # tokens 5 6 0 5 6 0 5 6
    assert sample["tokens"].tolist() == [5, 6, EOD, 5, 6, EOD, 5, 6]
    assert sample["loss_mask"].tolist() == [1, 1, 0, 1, 1, 0, 1, 1]  # none after an EOD input
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert torch.equal(sample["attention_mask"], torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]))


def test_its_sample_flags_are_validated_like_the_built_ins(third_party_data, monkeypatch):
    from plugtron.plugins.layer_backends.te import TEBackend

    monkeypatch.setattr(TEBackend, "supports_document_ids", False)  # a backend that cannot
    config = _config(**{"reset-attention-mask": True, "layer-backend": "te"})
    with pytest.raises(ConfigError, match="--reset-attention-mask is not supported by "
                                          "--layer-backend te"):
        validate(config, world_size=1)
