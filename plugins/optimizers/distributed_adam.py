"""Optimizer ``distributed-adam`` (alias ``--use-distributed-optimizer``): AdamW whose fp32 main
parameters and moments are sharded over the data-parallel group; gradients are reduce-scattered
and parameters all-gathered (overlapped with the next forward under ``--overlap-param-gather``).
Weight decay is not applied to norms and biases."""

from __future__ import annotations

import torch
from plugtron.core.hookspecs import hookimpl

from .distributed_optimizer import DistributedOptimizer


class DistributedAdam:
    #: Read by the core's data-parallel wrapper: lay gradients out in padded, sharded buckets.
    shards_grad_buffers = True

    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        t = config.training

        def make(groups):
            return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                     eps=t.adam_eps, weight_decay=t.weight_decay,
                                     foreach=True)

        return DistributedOptimizer(model_chunks, config, parallel, make)
