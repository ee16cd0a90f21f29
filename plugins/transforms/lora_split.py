"""Canonical LoRA (Megatron-Bridge's name): separate adapters for the projections that a fused
linear holds, as Hugging Face's PEFT adapts them: q, k and v of ``linear_qkv``; gate and up of a
gated MLP's ``linear_fc1``. Targets ``linear_q``, ``linear_k``, ``linear_v``,
``linear_fc1_gate``, ``linear_fc1_up`` (any subset: a projection without one adds nothing).

Each projection's adapter is a column-parallel :class:`LoRAAdapter` of that projection's output
features, split over tp like them; the fused output is laid out as Megatron-Core lays out the
base's: ``linear_qkv`` per query group, ``[q_1 .. q_n, k, v]`` for each group (a tp rank holds
whole groups, so its parts of q, k and v interleave into exactly its shard), ``linear_fc1``
as ``[gate; up]`` (each rank's shard ``[gate_r; up_r]``). Parameters are named
``<linear>.adapter.adapter_<q|k|v|gate|up>.linear_in.weight`` (A) and ``.linear_out.weight``
(B), as Megatron-Bridge names them.
"""

from __future__ import annotations

import torch
from plugtron.api import ConfigError

from .lora_adapter import COLUMN, LoRAAdapter

#: canonical target -> (the fused linear, its part's name)
CANONICAL = {"linear_q": ("linear_qkv", "q"), "linear_k": ("linear_qkv", "k"),
             "linear_v": ("linear_qkv", "v"), "linear_fc1_gate": ("linear_fc1", "gate"),
             "linear_fc1_up": ("linear_fc1", "up")}
#: each fused linear's parts, in the order its output holds them
PARTS = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}


def qkv_shape(model) -> tuple[int, int, int]:
    """(query heads, query groups, head size) of Megatron-Core's ``linear_qkv``."""
    heads = model.num_attention_heads
    return heads, model.num_query_groups or heads, model.kv_channels or \
        model.hidden_size // heads


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int,
                   dim: int) -> torch.Tensor:
    """q, k, v along ``dim`` (each ``groups`` equal blocks) -> ``[q_g, k_g, v_g]`` per group."""
    blocks = [t.unflatten(dim, (groups, -1)) for t in (q, k, v)]
    return torch.cat(blocks, dim=dim + 1 if dim >= 0 else dim).flatten(
        dim if dim >= 0 else dim - 1, dim + 1 if dim >= 0 else dim)


def fuse_parts(fused: str, parts: list[torch.Tensor], model, dim: int) -> torch.Tensor:
    """The parts (all of them, in ``PARTS`` order) laid out as the fused linear's output."""
    if fused == "linear_qkv":
        q, k, v = parts
        return interleave_qkv(q, k, v, qkv_shape(model)[1], dim)
    return torch.cat(parts, dim=dim)


def part_features(fused: str, name: str, weight_out: int, model) -> dict[str, int]:
    """Global output features of each part of the fused linear ``name``."""
    if fused == "linear_qkv":
        heads, groups, d = qkv_shape(model)
        if weight_out != (heads + 2 * groups) * d:
            raise ConfigError(f"canonical LoRA on {name}: its {weight_out} output features are "
                              f"not Megatron-Core's q, k, v of {heads} heads in {groups} groups "
                              f"of size {d}")
        return {"q": heads * d, "k": groups * d, "v": groups * d}
    return {"gate": weight_out // 2, "up": weight_out // 2}


class SplitAdapter(torch.nn.Module):
    """Adapters of some parts of a fused column-parallel linear (``adapter_q`` ...)."""

    def __init__(self, base: torch.nn.Module, name: str, kind: str, *, parts: list[str],
                 model, **options):
        super().__init__()
        fused = name.rpartition(".")[2]
        if kind != COLUMN:
            raise ConfigError(f"canonical LoRA on {name}: a row-parallel linear has no parts")
        weight = base.weight
        assert isinstance(weight, torch.nn.Parameter)  # parallel_kind found it
        tp = options["parallel"].tp_size
        if fused == "linear_fc1" and getattr(weight, "partition_chunks", 1) != 2:
            raise ConfigError(f"--lora-target-modules linear_fc1_gate/linear_fc1_up: {name} is "
                              f"not a gated [gate; up] projection (--swiglu)")
        self.fused, self.model = fused, model
        self.features = part_features(fused, name, weight.shape[0] * tp, model)
        self.local = {p: n // tp for p, n in self.features.items()}
        self.parts = [p for p in PARTS[fused] if p in parts]
        for part in self.parts:
            self.add_module(f"adapter_{part}", LoRAAdapter(
                base, name, kind, part=(part, self.features[part]), **options))
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = {p: getattr(self, f"adapter_{p}")(x) for p in self.parts}
        shape = next(iter(outs.values())).shape[:-1]
        like = next(iter(outs.values()))
        parts = [outs[p] if p in outs else like.new_zeros(*shape, self.local[p])
                 for p in PARTS[self.fused]]
        if self.fused == "linear_qkv":
            q, k, v = parts
            return interleave_qkv(q, k, v, qkv_shape(self.model)[1] // self.tp, -1)
        return torch.cat(parts, dim=-1)
