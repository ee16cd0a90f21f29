"""Layer type ``-``: pre-norm MLP, GeLU or SwiGLU, split column-then-row over tp.

Children as in Megatron-Core, so parameters read ``decoder.layers.{i}.pre_mlp_layernorm.*`` and
``decoder.layers.{i}.mlp.{linear_fc1,linear_fc2}.*``, alone or composed with ``*`` under the same
index (a GPT layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import normal_init, scaled_normal_init

from .attention import dropout


class MLP(torch.nn.Module):
    """fc1, activation, fc2 (no norm, no residual): ``mlp`` of a decoder layer."""

    def __init__(self, config, backend, prefix: str, seed: int):
        super().__init__()
        m = config.model
        ffn = m.ffn_hidden_size or 4 * m.hidden_size
        self.swiglu = m.swiglu
        # Init keys are the parameters' final names: the same weights under every layout.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.linear_fc1(x)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        out, _ = self.linear_fc2(x)
        return out


class MLPLayer(torch.nn.Module):
    """``hidden + dropout(mlp(pre_mlp_layernorm(hidden)))``."""

    symbol = "-"
    supports_context_parallel = True  # per token: nothing crosses the sequence

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        m = config.model
        self.backend = backend
        self.pre_mlp_layernorm = backend.norm(m.hidden_size)
        self.mlp = MLP(config, backend, f"decoder.layers.{layer_number - 1}.mlp", seed)
        self.hidden_dropout = m.hidden_dropout

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        out = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + dropout(out, self.hidden_dropout, self.training, self.backend)
