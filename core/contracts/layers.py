"""Decoder sub-layer types, found by their one-character symbol (entry-point group
``plugtron.layers``).

A layer type is a ``torch.nn.Module`` class with a class attribute ``symbol`` (one character,
unique over the installed layer types) and the constructor
``(config, backend, parallel, layer_number, seed)`` where ``layer_number`` is the 1-based global
index of the transformer layer it belongs to (so initialisation does not depend on the layout).
``forward(hidden, position=None)`` returns the new residual stream (the residual is added inside);
``position`` is whatever position encoding the model computes once per forward (rope's cos and
sin, say), passed positionally, or None.

A layer type is a whole decoder layer on its own, and its children name its parameters under
``decoder.layers.{layer_number - 1}`` (``*``: ``input_layernorm``, ``self_attention``; ``-``:
``pre_mlp_layernorm``, ``mlp``), so it should seed each weight's init by that final name. Several
types under one layer index (a GPT layer is ``*`` then ``-``) are run as one decoder layer by
:class:`plugtron.core.blocks.layer_stack.ComposedLayer`, which keeps those names flat.

A layer type may also take another's place at chosen layers (:func:`substitute_symbols`): the
model asks the registry which symbol runs in each slot of its pattern at each layer. It names the
parts ``--recompute-granularity selective`` may recompute in a class attribute
``recompute_modules`` (a tuple of Megatron's names, e.g. ``("mlp", "layernorm")``); the core
accepts in ``--recompute-modules`` exactly the names the installed layer types declare.
"""

from __future__ import annotations

from plugtron.core.errors import PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.objects import warn_once


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


def installed_layer_types() -> list[type]:
    """Every installed layer type that imports (a broken one is skipped with a warning: it must
    not break runs that do not use it)."""

    out = []
    for info in registry.available("layer"):
        try:
            out.append(registry.load("layer", info.name))
        except PluginError as exc:
            warn_once(f"skipping layer type {info.name!r}: {exc}")
    return out


def substitute_symbols(pattern: str, config, layer_numbers, types=None) -> dict[int, str]:
    """The symbols each decoder layer actually runs: ``pattern`` (e.g. GPT's ``"*-"``) with
    every symbol that an installed layer type claims at that layer replaced by that type's own.

    A layer type claims a slot through an optional classmethod
    ``substitutes_for(config, symbol, layer_number) -> bool`` (``layer_number`` 1-based): the
    MoE layer ``E`` claims ``-`` on the layers ``--moe-layer-freq`` selects when
    ``--num-experts`` is set. So a model asks "what runs here?" without knowing which plugin
    answers, and no model imports the MoE plugin. Two types claiming the same slot is an error.
    """
    types = installed_layer_types() if types is None else types
    claimers = [cls for cls in types if callable(getattr(cls, "substitutes_for", None))]
    out = {}
    for number in layer_numbers:
        symbols = []
        for symbol in pattern:
            winners = [cls for cls in claimers
                       if cls.substitutes_for(config=config, symbol=symbol, layer_number=number)]
            if len(winners) > 1:
                raise PluginError(f"layer {number}: symbol {symbol!r} is claimed by more than "
                                  f"one layer type: "
                                  + ", ".join(f"{c.__module__}.{c.__name__}" for c in winners))
            symbols.append(winners[0].symbol if winners else symbol)
        out[number] = "".join(symbols)
    return out
