"""Data-parallel wrapper ``ddp`` (the default): Megatron-Core's DistributedDataParallel.

Every rank holds whole parameters (in the training dtype) and gradient buffers (fp32 under
``--accumulate-allreduce-grads-in-fp32``); buckets are all-reduced, or reduce-scattered for a
sharding optimizer (``distributed-adam``, ``--data-parallel-sharding-strategy optim``).
"""

from __future__ import annotations

from plugtron.api import (
    ConfigError,
    DataParallelMemory,
    DistributedDataParallel,
    PluginError,
    hookimpl,
    model_dtype,
    wants_sharded_gradients,
)


class DDP:
    @hookimpl
    def plugtron_validate(self, config):
        # The parameter gather is the core DDP's, over a sharding optimizer's buffers.
        if config.parallel.overlap_param_gather:
            try:
                sharded = wants_sharded_gradients(config)
            except PluginError:
                sharded = True  # an unknown optimizer is reported by the plugin check
            if not sharded:
                raise ConfigError("--overlap-param-gather needs a sharding optimizer: add "
                                  "--use-distributed-optimizer (or --optimizer "
                                  "distributed-adam)")

    @hookimpl
    def wrap_model_chunk(self, config, module, parallel, shard_gradients):
        module.to(dtype=model_dtype(config))
        return DistributedDataParallel(module, config, parallel, sharded=shard_gradients)

    @hookimpl
    def data_parallel_memory(self, config, chunks, dp_cp, edp, state_values, shard_gradients):
        mixed = model_dtype(config).itemsize == 2
        e = model_dtype(config).itemsize
        grad_e = 4 if mixed and config.parallel.accumulate_allreduce_grads_in_fp32 else e
        numel = sum(q.numel() for chunk in chunks for q in chunk.parameters())
        # frozen parameters have no gradient buffer and no optimizer state
        trainable = [q for chunk in chunks for q in chunk.parameters() if q.requires_grad]
        optimizer = sum(q.numel() * (4 * state_values(q) + (4 if mixed else 0))
                        for q in trainable)
        if shard_gradients:
            optimizer = -(-optimizer // dp_cp)
        return DataParallelMemory(param_bytes=numel * e,
                                  grad_bytes=sum(q.numel() for q in trainable) * grad_e,
                                  optimizer_bytes=optimizer)
