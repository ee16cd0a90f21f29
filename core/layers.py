"""Decoder sub-layer types, found by their one-character symbol (entry-point group
``plugtron.layers``).

A layer type is a ``torch.nn.Module`` class with a class attribute ``symbol`` (``*`` attention,
``-`` MLP, ``M`` Mamba, ``E`` MoE, ...) and the constructor
``(config, backend, parallel, layer_number, seed)`` where ``layer_number`` is the 1-based global
index of the transformer layer it belongs to (so initialisation does not depend on the layout).
``forward(hidden, rotary=None)`` returns the new residual stream (the residual is added inside).

A layer type is a whole decoder layer on its own, and its children name its parameters under
``decoder.layers.{layer_number - 1}`` (``*``: ``input_layernorm``, ``self_attention``; ``-``:
``pre_mlp_layernorm``, ``mlp``), so it should seed each weight's init by that final name. Several
types under one layer index (a GPT layer is ``*`` then ``-``) are run as one decoder layer by
:class:`plugtron.core.layer_stack.ComposedLayer`, which keeps those names flat.
"""

from __future__ import annotations

from . import registry
from .errors import PluginError


def load_layer_types(symbols: str) -> dict[str, type]:
    """Map each needed symbol to its layer class. Layer plugins are loaded only until every
    needed symbol is found, so a broken plugin for an unused symbol costs nothing."""
    needed = set(symbols) - {"|"}
    found: dict[str, type] = {}
    failures = []
    for info in registry.available("layer"):
        if needed <= set(found):
            break
        try:
            cls = registry.load("layer", info.name)
        except PluginError as exc:
            failures.append(str(exc))
            continue
        symbol = getattr(cls, "symbol", None)
        if symbol in found and symbol in needed:
            raise PluginError(f"layer symbol {symbol!r} is registered twice: "
                              f"{found[symbol].__module__} and {cls.__module__}")
        if symbol:
            found[symbol] = cls
    missing = needed - set(found)
    if missing:
        known = ", ".join(f"{s!r} ({c.__name__})" for s, c in sorted(found.items()))
        hint = ("; " + "; ".join(failures)) if failures else ""
        raise PluginError(f"no layer type for symbol(s) {', '.join(sorted(missing))}; known: "
                          f"{known or 'none'}{hint}")
    return {s: found[s] for s in needed}
