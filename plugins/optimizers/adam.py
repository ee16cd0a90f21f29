"""Optimizer ``adam``: AdamW with decoupled weight decay (not on norms and biases)."""

from __future__ import annotations

import torch
from plugtron.core.hookspecs import hookimpl
from plugtron.core.optimizer import TorchOptimizer


class Adam:
    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        t = config.training

        def make(groups):
            return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                     eps=t.adam_eps, weight_decay=t.weight_decay,
                                     foreach=True)

        return TorchOptimizer(model_chunks, config, parallel, make)
