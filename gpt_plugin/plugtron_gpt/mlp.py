"""Layer type ``-``: pre-norm MLP, GeLU or SwiGLU, split column-then-row over tp."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.core.init import normal_init, scaled_normal_init

from .attention import dropout


class MLPLayer(torch.nn.Module):
    symbol = "-"

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        m = config.model
        ffn = m.ffn_hidden_size or 4 * m.hidden_size
        prefix = f"decoder.layers.{layer_number - 1}.mlp"
        self.backend = backend
        self.swiglu = m.swiglu
        self.pre_mlp_layernorm = backend.norm(m.hidden_size)
        # SwiGLU's fc1 is [gate; up]: two blocks that tp splits separately.
        self.linear_fc1 = backend.column_parallel_linear(
            m.hidden_size, ffn * (2 if m.swiglu else 1), bias=m.add_bias_linear,
            init_method=normal_init(m.init_method_std, seed, f"{prefix}.linear_fc1.weight"),
            partition_chunks=2 if m.swiglu else 1)
        self.linear_fc2 = backend.row_parallel_linear(
            ffn, m.hidden_size, bias=m.add_bias_linear,
            init_method=scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                           f"{prefix}.linear_fc2.weight"),
            input_is_parallel=True)
        self.hidden_dropout = m.hidden_dropout

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        x, _ = self.linear_fc1(self.pre_mlp_layernorm(hidden))
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        out, _ = self.linear_fc2(x)
        return hidden + dropout(out, self.hidden_dropout, self.training, self.backend)
