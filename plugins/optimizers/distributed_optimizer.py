"""A torch optimizer over this data-parallel rank's shard of every gradient bucket (ZeRO-1, as
Megatron-Core's DistributedOptimizer).

The data-parallel wrapper lays gradients and parameters out in flat, padded buckets and
reduce-scatters the gradients, so that rank ``r`` holds the summed gradient of the ``r``-th
equal, contiguous range of each bucket (ranges ignore parameter boundaries). It describes that
layout through its public ``optimizer_shards()`` (``plugtron.api.BucketShard``). This
optimizer keeps fp32 main parameters and optimizer state for those ranges only: one main tensor
per (parameter, shard) intersection, so weight decay can still follow the parameter. After the
step the updated range is written into the parameter's storage and all-gathered by the wrapper's
``start_param_sync()``.
"""

from __future__ import annotations

import torch
from plugtron.api import (
    OPTIMIZER_STATE_KEY,
    MixedPrecisionOptimizer,
    PluginError,
    all_gather_tensor,
    no_weight_decay,
)


def bucket_shards(model_chunks) -> list:
    """Every chunk's ``BucketShard`` list, chunk after chunk (the same order on every rank)."""
    out = []
    for chunk in model_chunks:
        if not getattr(chunk, "sharded", False) or not hasattr(chunk, "optimizer_shards"):
            raise PluginError("the distributed optimizer needs model chunks wrapped by the core's "
                              "DistributedDataParallel with sharded gradient buffers (its plugin "
                              "must answer hook optimizer_shards_gradients with True)")
        out += chunk.optimizer_shards()
    return out


class DistributedOptimizer(MixedPrecisionOptimizer):
    #: Adam's per-element state, in the order it is saved.
    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_chunks, config, parallel, make_inner):
        super().__init__(config, parallel)
        self.model_chunks = list(model_chunks)
        self.bucket_shards = bucket_shards(self.model_chunks)
        # One entry per (parameter, shard) piece; ``slices_of[b]`` indexes bucket b's pieces.
        self.slices, self.slices_of = [], []
        for bucket in self.bucket_shards:
            self.slices_of.append(range(len(self.slices), len(self.slices) + len(bucket.shards)))
            self.slices += bucket.shards
        # fp32 model parameters are their own main parameters (a view of the parameter
        # storage); bf16/fp16 ones get fp32 copies of the shard.
        self.aliased = [bucket.param_dtype == torch.float32
                        for bucket in self.bucket_shards for _ in bucket.shards]
        self.mains = [s.data if aliased else s.data.detach().float().clone()
                      for s, aliased in zip(self.slices, self.aliased)]
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

    def prepare_main_grads(self):
        for chunk in self.model_chunks:
            chunk.finish_param_sync()  # the step rewrites the parameter storage
        pairs = []
        for s, main in zip(self.slices, self.mains):
            main.grad = s.grad if s.grad.dtype == torch.float32 else s.grad.float()
            pairs.append((main.grad, s.param))
        return pairs

    def publish_main_params(self) -> None:
        copies = self._copied_pairs()
        if copies:
            with torch.no_grad():  # one fused copy (with the cast) over every shard
                torch._foreach_copy_([s for s, _ in copies], [m for _, m in copies])
        # the core then calls every chunk's start_param_sync(), which all-gathers the shards

    def reload_model_params(self) -> None:
        copies = self._copied_pairs()
        if copies:
            with torch.no_grad():
                torch._foreach_copy_([m for _, m in copies], [s for s, _ in copies])

    def _copied_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(model shard, fp32 main)`` where the main parameter is a copy (bf16/fp16)."""
        return [(s.data, main) for s, main, aliased in zip(self.slices, self.mains, self.aliased)
                if not aliased]

    def main_param_bytes(self) -> int:
        return sum(m.numel() * m.element_size()
                   for m, aliased in zip(self.mains, self.aliased) if not aliased)

    # ------------------------------------------------------------------ checkpoint state

    def _keys_for(self, bucket) -> list[str]:
        keys = list(self.STATE_KEYS) if self.num_steps > 0 else []
        if bucket.param_dtype != torch.float32:
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
        state: dict = {}
        for bucket, indices in zip(self.bucket_shards, self.slices_of):
            for member in bucket.params:
                state[member.name] = {}
            for key in self._keys_for(bucket):
                local = torch.zeros(bucket.shard_size, dtype=torch.float32, device=bucket.device)
                for index in indices:
                    lo, hi = self.slices[index].shard_range
                    local[lo:hi] = self._value(index, key)
                full = all_gather_tensor(local, bucket.group)
                for member in bucket.params:
                    lo, hi = member.bucket_range
                    state[member.name][key] = full[lo:hi].view(member.param.shape).clone()
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
            lo, hi = s.param_range
            saved = {k: v.reshape(-1)[lo:hi] for k, v in state.get(s.name, {}).items()}
            if "main_param" in saved:  # the fp32 master weights beat a bf16 model's
                with torch.no_grad():
                    main.copy_(saved["main_param"])
                    if not aliased:
                        s.data.copy_(main)
            entries = self.inner_state_for(main, saved, s.name)
            if entries:
                self.inner.state[main] = entries
            else:
                self.inner.state.pop(main, None)
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)
