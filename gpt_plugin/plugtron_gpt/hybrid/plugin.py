"""The ``hybrid`` model plugin: Megatron-Core's hybrid model (Mamba-2, attention, MLP and MoE
layers by pattern). Forward step and loss are the GPT model's."""

from __future__ import annotations

from plugtron.api import ModelInfo, hookimpl
from plugtron_gpt.gpt.loss_options import SECTION as LOSS_SECTION
from plugtron_gpt.gpt.plugin import MAIN_LOSS, GPTPlugin
from plugtron_gpt.hybrid.model import HybridModel
from plugtron_gpt.hybrid.options import SECTION
from plugtron_gpt.hybrid.sizes import hybrid_architecture, validate_hybrid


class HybridPlugin(GPTPlugin):
    @hookimpl
    def plugtron_config_sections(self):
        return [SECTION, LOSS_SECTION]

    @hookimpl
    def plugtron_validate(self, config):
        validate_hybrid(config)

    @hookimpl
    def model_info(self, config):
        return ModelInfo(main_loss=MAIN_LOSS, architecture=hybrid_architecture(config),
                         places_layers=True)

    @hookimpl
    def model_presets(self):
        return {}

    @hookimpl
    def model_provider(self, config, pre_process, post_process, vp_stage, layer_backend,
                       parallel):
        return HybridModel(config, layer_backend, parallel, pre_process, post_process, vp_stage)
