"""Optimizer ``sgd``: SGD with momentum and weight decay (not on norms and biases)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from plugtron.api import ConfigSection, TorchOptimizer, hookimpl, opt


@dataclass
class SGDOptions:
    sgd_momentum: float = opt(0.9, "--sgd-momentum", "SGD momentum.")


class SGD:
    @hookimpl
    def plugtron_config_sections(self):
        # before contract 3 the field was config.training.sgd_momentum
        return [ConfigSection("sgd", SGDOptions, title="SGD", formerly=("training",))]

    @hookimpl
    def optimizer_state_per_param(self, config, name, param):
        return 1 if config.sgd.sgd_momentum else 0  # the momentum buffer

    @hookimpl
    def optimizer_takes_dtensor_params(self, config):
        return True  # TorchOptimizer steps fsdp2's shards

    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        t = config.training

        def make(groups):
            return torch.optim.SGD(groups, lr=t.lr, momentum=config.sgd.sgd_momentum,
                                   weight_decay=t.weight_decay, foreach=True)

        return TorchOptimizer(model_chunks, config, parallel, make)
