"""Optimizer ``distributed-adam`` (alias ``--use-distributed-optimizer``): AdamW whose fp32 main
parameters and moments are sharded over the data-parallel group; gradients are reduce-scattered
and parameters all-gathered (overlapped with the next forward under ``--overlap-param-gather``).
Weight decay is not applied to norms and biases."""

from __future__ import annotations

from plugtron.api import hookimpl

from .adam_options import SECTION, adamw
from .distributed_optimizer import DistributedOptimizer


class DistributedAdam:
    @hookimpl
    def plugtron_config_sections(self):
        return [SECTION]

    @hookimpl
    def optimizer_state_per_param(self, config, name, param):
        return 2  # the two moments, sharded over dp x cp

    @hookimpl
    def optimizer_shards_gradients(self, config):
        # The core's data-parallel wrapper then lays gradients out in padded, sharded buckets.
        return True

    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        return DistributedOptimizer(model_chunks, config, parallel, adamw(config))
