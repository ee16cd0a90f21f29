"""Compose layer types into one decoder layer with flat, Megatron-Core-style parameter names.

A layer type (core/contracts/layers.py) is a whole residual block on its own: the Hybrid model uses one
symbol per decoder layer, so ``decoder.layers.{j}`` is a single ``*`` and reads
``decoder.layers.{j}.input_layernorm``, ``decoder.layers.{j}.self_attention``. A GPT layer is ``*``
then ``-`` under the *same* index, and Megatron-Core names it
``decoder.layers.{i}.input_layernorm``, ``.self_attention``, ``.pre_mlp_layernorm``, ``.mlp``: no
level for the layer type. :class:`ComposedLayer` gives exactly that. It registers the children of
every part on itself, so each parameter has one name and no part adds a level, and it runs the
parts in order::

    layer = ComposedLayer([attention_type(...), mlp_type(...)])
    hidden = layer(hidden, position)

Any model may use it; nothing here knows GPT.
"""

from __future__ import annotations

from typing import Iterable

import torch
from plugtron.core.contracts.activations import module_activation_bytes, module_weight_grad_bytes


class ComposedLayer(torch.nn.Module):
    """Run several layer-type modules in sequence as ONE decoder layer.

    ``parts``: the layer-type modules, in the order they run; each has
    ``forward(hidden, position=None)`` and returns the new residual stream. The children of every
    part become children of this module under their own names, so a part's parameters are named
    ``<this layer>.<child>.<...>``.

    Refused with ``ValueError``: no parts; two parts with a child of the same name (their
    parameters would share a name); a part that holds a parameter or buffer itself rather than
    in a child (it would have no name here, so checkpoints and optimizers would not see it).

    ``train()`` / ``eval()`` reach the parts too: they read their own ``self.training`` (for
    dropout on the residual stream).
    """

    def __init__(self, parts: Iterable[torch.nn.Module]):
        super().__init__()
        parts = tuple(parts)
        if not parts:
            raise ValueError("ComposedLayer needs at least one part")
        owners: dict[str, str] = {}
        for part in parts:
            part_name = type(part).__name__
            direct = [name for name, _ in part.named_parameters(recurse=False)]
            direct += [name for name, _ in part.named_buffers(recurse=False)]
            if direct:
                raise ValueError(
                    f"ComposedLayer: {part_name} holds {', '.join(direct)} itself, not in a "
                    f"child module; put it in a child so that it keeps a name")
            for child_name, child in part.named_children():
                if child_name in owners:
                    raise ValueError(
                        f"ComposedLayer: {owners[child_name]} and {part_name} both have a "
                        f"child named {child_name!r}; their parameters would share names")
                owners[child_name] = part_name
                self.add_module(child_name, child)
        # A tuple is not registered as a submodule: the parts add no level to the names and each
        # parameter is reachable (and named) once, through the children registered above.
        self._parts = parts

    @property
    def parts(self) -> tuple[torch.nn.Module, ...]:
        """The layer-type modules, in the order they run."""
        return self._parts

    def activation_bytes(self, shape) -> int:
        """What the parts keep for backward together (core/contracts/activations.py)."""

        return sum(module_activation_bytes(part, shape) for part in self._parts)

    def weight_grad_bytes(self, shape) -> int:
        """What the parts keep from a split backward's I to its W together."""
        return sum(module_weight_grad_bytes(part, shape) for part in self._parts)

    def train(self, mode: bool = True) -> ComposedLayer:
        super().train(mode)
        for part in self._parts:
            part.train(mode)
        return self

    def forward(self, hidden: torch.Tensor, position: object = None) -> torch.Tensor:
        for part in self._parts:
            hidden = part(hidden, position)
        return hidden
