"""SharedExpertMLP (``mlp.shared_experts``): a dense MLP every token goes through, optionally
scaled by a sigmoid gate ``sigmoid(x @ gate_weight.T)`` (Qwen2-MoE's ``shared_expert_gate``).

It is an ordinary tensor-parallel MLP built from the run's layer backend, so its parameters are
dense (reduced over dp): ``linear_fc1.weight``, ``linear_fc2.weight``, ``gate_weight [1, H]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import linear, normal_init, scaled_normal_init

from .experts import gelu_approximation


class SharedExpertMLP(torch.nn.Module):
    def __init__(self, config, backend, prefix: str, seed: int):
        super().__init__()
        m, o = config.model, config.moe
        size = o.moe_shared_expert_intermediate_size
        self.swiglu = m.swiglu
        self.gelu_approximation = gelu_approximation(config)
        self.linear_fc1 = backend.column_parallel_linear(
            m.hidden_size, size * (2 if m.swiglu else 1), bias=m.add_bias_linear,
            init_method=normal_init(m.init_method_std, seed, f"{prefix}.linear_fc1.weight"),
            partition_chunks=2 if m.swiglu else 1)
        self.linear_fc2 = backend.row_parallel_linear(
            size, m.hidden_size, bias=m.add_bias_linear,
            init_method=scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                           f"{prefix}.linear_fc2.weight"),
            input_is_parallel=True)
        self.gate_weight = None
        if o.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(normal_init(
                m.init_method_std, seed, f"{prefix}.gate_weight")((1, m.hidden_size)))
            if backend.sequence_parallel:
                self.gate_weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, s, h]`` (sequence-sharded under SP) -> the same shape."""
        h, _ = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approximation)
        out, _ = self.linear_fc2(h)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(linear(x, self.gate_weight))
        return out
