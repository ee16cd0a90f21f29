"""SharedExpertMLP (``mlp.shared_experts``): a dense MLP every token goes through, optionally
scaled by a sigmoid gate ``sigmoid(x @ gate_weight.T)`` (Qwen2-MoE's ``shared_expert_gate``).

The dense MLP is the run's MLP layer type's own (found by its symbol ``-`` in the layer registry,
its ``dense_block``), so it has the same activation and biases as the model's MLP layers and
plugtron-moe does not write an MLP again. Its parameters are dense (reduced over dp) and keep
Megatron's names: ``linear_fc1.weight``, ``linear_fc2.weight``, ``gate_weight [1, H]``.
"""

from __future__ import annotations

from typing import Any

import torch
from plugtron.api import linear, load_layer_types, mark_sequence_parallel, normal_init

#: The symbol of the MLP layer type whose dense block the shared experts are.
MLP_SYMBOL = "-"


class SharedExpertMLP(torch.nn.Module):
    def __init__(self, config, backend, prefix: str, seed: int):
        super().__init__()
        m, o = config.model, config.moe
        # plugtron-gpt's MLP layer type (a declared requirement of plugtron-moe) builds it
        mlp_type: Any = load_layer_types(MLP_SYMBOL)[MLP_SYMBOL]
        dense = mlp_type.dense_block(
            config, backend, prefix, seed, ffn=o.moe_shared_expert_intermediate_size)
        # The block's children are this module's own (no level in the names); it runs them.
        for name, child in dense.named_children():
            self.add_module(name, child)
        self.__dict__["_dense"] = dense
        self.gate_weight = None
        if o.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(normal_init(
                m.init_method_std, seed, f"{prefix}.gate_weight")((1, m.hidden_size)))
            if backend.sequence_parallel:
                mark_sequence_parallel(self.gate_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, s, h]`` (sequence-sharded under SP) -> the same shape."""
        out = self.__dict__["_dense"](x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(linear(x, self.gate_weight))
        return out
