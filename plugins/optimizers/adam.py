"""Optimizer ``adam``: AdamW with decoupled weight decay (not on norms and biases)."""

from __future__ import annotations

from plugtron.api import TorchOptimizer, hookimpl

from .adam_options import SECTION, adamw


class Adam:
    @hookimpl
    def plugtron_config_sections(self):
        return [SECTION]

    @hookimpl
    def optimizer_state_per_param(self, config, name, param):
        return 2  # the two moments of every element

    @hookimpl
    def optimizer_takes_dtensor_params(self, config):
        return True  # TorchOptimizer steps fsdp2's shards

    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        return TorchOptimizer(model_chunks, config, parallel, adamw(config))
