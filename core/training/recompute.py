"""Activation recompute (Megatron's ``--recompute-granularity``, ``--recompute-method``,
``--recompute-num-layers``, ``--recompute-modules``).

A recomputed region keeps only its inputs during forward and runs again inside backward. The
second run must draw the same random numbers as the first, or dropout masks (and so gradients)
differ: :func:`recompute` restores the default generators (torch's checkpoint does that) AND every
named stream of every :class:`~plugtron.core.parallel.random.RNGStatesTracker` (the model-parallel and
expert streams dropout draws from under tp/sp and inside experts), and re-enters the forward
context of the first run (document ids, ...), then puts the streams back where the backward found
them. So a run with recompute gives bitwise the losses of the same run without it.

* ``full``: whole decoder layers. ``uniform`` groups the chunk's layers into runs of
  ``--recompute-num-layers`` and recomputes each group from its input; ``block`` recomputes the
  first ``--recompute-num-layers`` layers of each chunk one by one and keeps the rest.
* ``selective``: only the parts a layer type names. Each layer type declares the names of its
  parts as ``recompute_modules`` (Megatron's names: ``core_attn``, ``mlp``, ``layernorm``, ...;
  ``core_attn`` when the flag is not given); a layer asks :func:`recompute_module` and wraps that
  part in :func:`recompute`. ``--recompute-modules`` takes the names the installed layer types
  declare.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Sequence

import torch
import torch.utils.checkpoint
from plugtron.core.blocks.forward_context import current_forward_context, use_forward_context
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.plugins import registry

#: Megatron's default part for selective recompute.
DEFAULT_MODULES = ("core_attn",)

_trackers: "weakref.WeakSet" = weakref.WeakSet()
_rerunning = [0]


def is_recomputing() -> bool:
    """True while a recomputed forward runs inside backward: layers skip their side effects
    there (reported losses, token counts for balancing), which the first run already did."""
    return _rerunning[0] > 0


def register_tracker(tracker) -> None:
    """Streams of ``tracker`` are restored for every recomputed forward (called by the tracker)."""
    _trackers.add(tracker)


class _Replay:
    """The two contexts torch's checkpoint runs the first forward and the recompute under."""

    def __init__(self):
        self.streams = {tracker: tracker.get_state() for tracker in list(_trackers)}
        self.context = current_forward_context()
        # A microbatch whose backward is split (I + W) builds deferrable layers: the recompute,
        # which runs inside its I, must build the same graph (and so defers the same weights).
        self.split = wgrad.split_backward_expected()

    @contextlib.contextmanager
    def first_run(self):
        yield

    @contextlib.contextmanager
    def rerun(self):
        now = {tracker: tracker.get_state() for tracker in self.streams}
        for tracker, states in self.streams.items():
            tracker.set_state(states)
        _rerunning[0] += 1
        split = wgrad.expecting_split_backward() if self.split else contextlib.nullcontext()
        try:
            with use_forward_context(self.context), split:
                yield
        finally:
            _rerunning[0] -= 1
            for tracker, states in now.items():
                tracker.set_state(states)


def recompute(function: Callable, *args):
    """``function(*args)``, keeping only ``args`` for backward and running it again there with
    the same random streams and forward context. Without grad (evaluation) it just runs."""
    if not torch.is_grad_enabled():
        return function(*args)
    replay = _Replay()
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (replay.first_run(), replay.rerun()))


def recompute_module(config, name: str) -> bool:
    """Whether a layer should recompute its part ``name`` (selective granularity)."""
    t = config.training
    return t.recompute_granularity == "selective" and name in selected_modules(config)


def _given_modules(config) -> list[str]:
    modules = []
    for item in config.training.recompute_modules:
        modules += [m for m in str(item).split(",") if m]
    return modules


def selected_modules(config) -> list[str]:
    return _given_modules(config) or list(DEFAULT_MODULES)


def declared_modules() -> list[str]:
    """The part names the installed layer types declare (``recompute_modules``), in first-seen
    order; a layer type that fails to import is left out (its options are skipped the same
    way)."""
    names: dict[str, None] = dict.fromkeys(DEFAULT_MODULES)
    for info in registry.available("layer"):
        try:
            layer_type = registry.load("layer", info.name)
        except PluginError:
            continue
        names.update(dict.fromkeys(getattr(layer_type, "recompute_modules", ())))
    return list(names)


def recompute_plan(config, num_layers: int) -> list[tuple[int, int, bool]]:
    """``(start, end, recompute)`` runs over a chunk's ``num_layers`` layers (full granularity)."""
    t = config.training
    if t.recompute_granularity != "full" or num_layers == 0:
        return [(0, num_layers, False)]
    n = t.recompute_num_layers
    if t.recompute_method == "block":
        n = min(n, num_layers)
        runs = [(i, i + 1, True) for i in range(n)]
        return runs + ([(n, num_layers, False)] if n < num_layers else [])
    return [(start, min(start + n, num_layers), True) for start in range(0, num_layers, n)]


def run_layers(layers: Sequence[torch.nn.Module], hidden: torch.Tensor, *args, config=None,
               training: bool = True) -> torch.Tensor:
    """Run ``layers`` in order on ``hidden`` (each called ``layer(hidden, *args)``), recomputing
    the groups :func:`recompute_plan` names when ``training`` and grad is on."""
    layers = list(layers)
    plan = recompute_plan(config, len(layers)) if config is not None and training else \
        [(0, len(layers), False)]
    for start, end, again in plan:
        group = layers[start:end]

        def run(hidden, *args, group=group):
            for layer in group:
                hidden = layer(hidden, *args)
            return hidden

        hidden = recompute(run, hidden, *args) if again else run(hidden, *args)
    return hidden


def validate_recompute(config) -> None:
    """Flags that would be silently ignored, or that name no module, are refused."""
    t = config.training
    if t.recompute_num_layers < 1:
        raise ConfigError(f"--recompute-num-layers must be at least 1, got "
                          f"{t.recompute_num_layers}")
    given = _given_modules(config)
    allowed = declared_modules() if given else []
    unknown = [m for m in given if m not in allowed]
    if unknown:
        raise ConfigError(f"--recompute-modules {', '.join(unknown)}: unknown; allowed (the "
                          f"installed layer types' parts): {', '.join(allowed)}")
    if t.recompute_granularity != "selective" and t.recompute_modules:
        raise ConfigError("--recompute-modules needs --recompute-granularity selective")
    if t.recompute_granularity is None and (t.recompute_num_layers != 1
                                            or t.recompute_method != "uniform"):
        raise ConfigError("--recompute-method and --recompute-num-layers need "
                          "--recompute-granularity full")
    if t.recompute_granularity == "selective" and (t.recompute_num_layers != 1
                                                   or t.recompute_method != "uniform"):
        raise ConfigError("--recompute-method and --recompute-num-layers apply to "
                          "--recompute-granularity full only")
