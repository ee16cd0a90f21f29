"""Optimizer ``adam``: AdamW with decoupled weight decay (not on norms and biases)."""

from __future__ import annotations

from plugtron.api import TorchOptimizer, adamw_factory, hookimpl


class Adam:
    #: fp32 values kept per parameter (the two moments), for ``plugtron estimate``.
    state_per_param = 2

    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        return TorchOptimizer(model_chunks, config, parallel, adamw_factory(config))
