"""The decoder of one pipeline chunk: ``decoder.layers.{i}`` and, on the last stage,
``decoder.final_layernorm`` (Megatron-Core's ``TransformerBlock`` names).

``layers`` is keyed by the *global* layer index, so a parameter's name is the same under every
tp/pp/vp layout: a chunk holding layers 4..7 has ``decoder.layers.4`` .. ``decoder.layers.7``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from plugtron.api import run_layers


class Decoder(torch.nn.Module):
    def __init__(self, layers: Mapping[int, torch.nn.Module],
                 final_layernorm: torch.nn.Module | None = None, config=None):
        super().__init__()
        self.config = config  # --recompute-granularity full reads it
        self.layers = torch.nn.ModuleDict({str(index): layer for index, layer in layers.items()})
        self.final_layernorm = final_layernorm

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        hidden = run_layers(list(self.layers.values()), hidden, rotary, config=self.config,
                            training=self.training)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden
