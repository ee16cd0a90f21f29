"""A torch optimizer over this data-parallel rank's shard of every gradient bucket (ZeRO-1, as
Megatron-Core's DistributedOptimizer).

The data-parallel wrapper lays gradients and parameters out in flat, padded buckets and
reduce-scatters the gradients, so that rank ``r`` holds the summed gradient of the ``r``-th
equal, contiguous range of each bucket (ranges ignore parameter boundaries). This optimizer keeps
fp32 main parameters and optimizer state for that range only: one main tensor per
(parameter, shard) intersection, so weight decay can still follow the parameter. After the step
the updated range is written into the parameter buffer and all-gathered by the wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from plugtron.core import comm
from plugtron.core.errors import PluginError
from plugtron.core.optimizer import (
    OPTIMIZER_STATE_KEY,
    MixedPrecisionOptimizer,
    named_params,
    no_weight_decay,
)


@dataclass
class ShardSlice:
    """The part of one parameter that falls in this rank's shard of one bucket."""

    name: str
    param: torch.nn.Parameter
    buffer: object  # GradBuffer
    bucket: object  # Bucket
    lo: int  # range in buffer coordinates
    hi: int
    param_lo: int  # the same range in the parameter's flattened coordinates
    param_hi: int


def shard_slices(model_chunks) -> list[ShardSlice]:
    names = {id(p): n for n, p in named_params(model_chunks)}
    out = []
    for chunk in model_chunks:
        buffers = getattr(chunk, "grad_buffers", None)
        if buffers is None or not all(b.sharded for b in buffers):
            raise PluginError("the distributed optimizer needs model chunks wrapped by the core's "
                              "DistributedDataParallel with sharded gradient buffers (its plugin "
                              "class must set shards_grad_buffers = True)")
        for buffer in buffers:
            for bucket in buffer.buckets:
                shard_lo, shard_hi = bucket.shard_range()
                for param in bucket.params:
                    p_lo, p_hi = buffer.ranges[id(param)]
                    lo, hi = max(p_lo, shard_lo), min(p_hi, shard_hi)
                    if lo < hi:
                        out.append(ShardSlice(names[id(param)], param, buffer, bucket, lo, hi,
                                              lo - p_lo, hi - p_lo))
    return out


class DistributedOptimizer(MixedPrecisionOptimizer):
    #: Adam's per-element state, in the order it is saved.
    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_chunks, config, parallel, make_inner):
        super().__init__(config, parallel)
        self.model_chunks = list(model_chunks)
        self.slices = shard_slices(self.model_chunks)
        # fp32 model parameters are their own main parameters (a view of the parameter
        # buffer); bf16/fp16 ones get fp32 copies of the shard.
        self.aliased = [s.buffer.param_data.dtype == torch.float32 for s in self.slices]
        self.mains = []
        for s, aliased in zip(self.slices, self.aliased):
            view = s.buffer.param_data[s.lo:s.hi]
            self.mains.append(view if aliased else view.detach().float().clone())
        decay, plain = [], []
        for s, main in zip(self.slices, self.mains):
            (plain if no_weight_decay(s.name, s.param) else decay).append(main)
        groups = [{"params": decay, "weight_decay": config.training.weight_decay},
                  {"params": plain, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if not groups:  # this rank's shards are all padding: nothing to step
            groups = [{"params": [torch.zeros(0)], "weight_decay": 0.0}]
        self.inner = make_inner(groups)
        self.norm_groups = (parallel.dp_cp_group,)
        self.expert_norm_groups = (parallel.edp_group,)  # expert buffers shard over edp

    # ------------------------------------------------------------------ the step

    def _prepare_main_grads(self):
        for chunk in self.model_chunks:
            chunk.finish_param_sync()  # the step rewrites the parameter buffer
        pairs = []
        for s, main in zip(self.slices, self.mains):
            grad = s.buffer.grad_data[s.lo:s.hi]
            main.grad = grad if grad.dtype == torch.float32 else grad.float()
            pairs.append((main.grad, s.param))
        return pairs

    def _publish_main_params(self) -> None:
        with torch.no_grad():
            for s, main, aliased in zip(self.slices, self.mains, self.aliased):
                if not aliased:
                    s.buffer.param_data[s.lo:s.hi].copy_(main)
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for s, main, aliased in zip(self.slices, self.mains, self.aliased):
                if not aliased:
                    main.copy_(s.buffer.param_data[s.lo:s.hi])

    def _main_param_bytes(self) -> int:
        return sum(m.numel() * m.element_size()
                   for m, aliased in zip(self.mains, self.aliased) if not aliased)

    # ------------------------------------------------------------------ checkpoint state

    def _keys_for(self, buffer) -> list[str]:
        keys = list(self.STATE_KEYS) if self.num_steps > 0 else []
        if buffer.param_data.dtype != torch.float32:
            keys.append("main_param")
        return keys

    def _value(self, index: int, key: str) -> torch.Tensor:
        main = self.mains[index]
        if key == "main_param":
            return main
        value = self.inner.state.get(main, {}).get(key)
        return torch.zeros_like(main) if value is None else value

    def sharded_state_dict(self) -> dict:
        """Every parameter's state at its full local shape: each bucket's shards are
        all-gathered over the data-parallel group (a collective)."""
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        by_bucket: dict[int, list[int]] = {}
        for index, s in enumerate(self.slices):
            by_bucket.setdefault(id(s.bucket), []).append(index)
        names = {id(p): n for n, p in named_params(self.model_chunks)}
        state: dict = {}
        for chunk in self.model_chunks:
            for buffer in chunk.grad_buffers:
                keys = self._keys_for(buffer)
                for bucket in buffer.buckets:
                    for param in bucket.params:
                        state[names[id(param)]] = {}
                    for key in keys:
                        local = torch.zeros(bucket.shard_size, dtype=torch.float32,
                                            device=bucket.grad.device)
                        shard_lo = bucket.shard_range()[0]
                        for index in by_bucket.get(id(bucket), ()):
                            s = self.slices[index]
                            local[s.lo - shard_lo:s.hi - shard_lo] = self._value(index, key)
                        full = comm.all_gather_tensor(local, buffer.group)
                        for param in bucket.params:
                            p_lo, p_hi = buffer.ranges[id(param)]
                            value = full[p_lo - bucket.start:p_hi - bucket.start]
                            state[names[id(param)]][key] = value.view(param.shape).clone()
        state[OPTIMIZER_STATE_KEY] = self.scalar_state()
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        """Keep this rank's shard of every full local tensor in ``state``; then refresh the
        model parameters from the main parameters (a collective all-gather)."""
        self.load_scalar_state(state.get(OPTIMIZER_STATE_KEY))
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        self.reload_model_params()
        for s, main, aliased in zip(self.slices, self.mains, self.aliased):
            saved = {k: v.reshape(-1)[s.param_lo:s.param_hi]
                     for k, v in state.get(s.name, {}).items()}
            if "main_param" in saved:  # the fp32 master weights beat a bf16 model's
                with torch.no_grad():
                    main.copy_(saved["main_param"])
                    if not aliased:
                        s.buffer.param_data[s.lo:s.hi].copy_(main)
            entries = self.inner_state_for(main, saved)
            if entries:
                self.inner.state[main] = entries
            else:
                self.inner.state.pop(main, None)
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)
