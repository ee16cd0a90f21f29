"""Deferred weight gradients: the split backward's ``I`` and ``W`` inside the layers.

A schedule that splits a microbatch's backward runs ``I`` (the gradient of the stage input,
which the previous stage waits for) and later ``W`` (the weight gradients). During ``I`` the
executor makes a :class:`WeightGradStore` the collecting store; a layer whose backward can
split calls :func:`defer_weight_grad` with its weight and a closure that computes that weight's
gradient (holding what the matmul needs, e.g. the layer input and the output gradient) and
returns ``None`` for the weight. ``W`` runs the stored closures and hands the gradients to
autograd (``torch.autograd.backward`` on the weights), so accumulation into ``.grad`` and the
parameters' post-accumulate-grad hooks (the data-parallel grad buffers) behave exactly as in a
combined backward, only later.

The contract for a layer (the local backend's linears follow it, a third-party layer may):

* At forward, :func:`split_backward_expected` says whether this microbatch's backward will be
  split. A layer may build its deferrable graph only then (the local ``linear`` does, so
  combined backwards run the very same kernels as before).
* In its backward, a layer calls ``defer_weight_grad(weight, compute)``. ``True``: the store
  took it, return ``None`` for the weight. ``False`` (no split is running, or the weight is not
  a leaf parameter): compute the gradient now, as usual.
* A layer that does nothing of this computes its weight gradients at ``I``: the fallback, exact
  too, only without filling the bubble. A layer type that knows it cannot split says so with a
  class attribute ``weight_grads_at_input = "the reason"``; a run whose schedule splits names
  those layers once at start.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

_state = threading.local()

#: Class attribute of a layer whose weight gradients a split backward cannot defer: the reason.
AT_INPUT_ATTRIBUTE = "weight_grads_at_input"


def weight_grads_at_input(modules) -> dict[str, str]:
    """``{class name: reason}`` of the modules that declare their weight gradients come at
    ``I`` (attribute :data:`AT_INPUT_ATTRIBUTE`)."""
    out = {}
    for module in modules:
        reason = getattr(type(module), AT_INPUT_ATTRIBUTE, None)
        if reason:
            out[type(module).__qualname__] = reason
    return out


def _current(name: str):
    return getattr(_state, name, None)


class WeightGradStore:
    """The weight-gradient work one ``I`` left for its ``W`` (one microbatch on one chunk)."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
        self._params: set[int] = set()

    def add(self, weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        self.pending.append((weight, compute))
        self._params.add(id(weight))

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._params

    def __len__(self) -> int:
        return len(self.pending)

    def run(self) -> None:
        """Compute the stored weight gradients and accumulate them through autograd. Several
        contributions to one weight are summed first, in the order the combined backward would
        meet them, and handed to autograd together, as its engine does for a leaf; each
        weight's gradient goes to autograd as soon as its last contribution is computed, and
        each closure (with the activations it holds) is dropped once run, so a W holds at most
        one weight's gradient beyond what it frees, not the whole chunk's."""
        pending, self.pending, self._params = self.pending, [], set()
        last = {id(weight): i for i, (weight, _) in enumerate(pending)}
        partial: dict[int, torch.Tensor] = {}
        for i in range(len(pending)):
            weight, compute = pending[i]
            pending[i] = None  # type: ignore[call-overload]  # frees what the closure held
            with torch.no_grad():  # as inside autograd's backward, where the closure was made
                grad = compute()
            del compute
            key = id(weight)
            if key in partial:
                grad = partial.pop(key) + grad
            if last[key] == i:
                torch.autograd.backward([weight], grad_tensors=[grad])
            else:
                partial[key] = grad
            del grad


@contextlib.contextmanager
def expecting_split_backward() -> Iterator[None]:
    """The executor runs a forward inside this when that microbatch's backward will be ``I`` +
    ``W``."""
    previous = _current("split_forward")
    _state.split_forward = True
    try:
        yield
    finally:
        _state.split_forward = previous


def split_backward_expected() -> bool:
    """True inside the forward of a microbatch whose backward will be split into ``I`` and
    ``W``: a layer builds its deferrable backward then."""
    return bool(_current("split_forward"))


@contextlib.contextmanager
def collecting_weight_grads(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """The executor runs an ``I`` inside this: deferred weight gradients go to ``store``."""
    previous = _current("store")
    _state.store = store
    try:
        yield store
    finally:
        _state.store = previous


def defer_weight_grad(weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> bool:
    """Called from a layer's backward: store ``compute`` (which returns ``weight``'s gradient
    for this microbatch) for the coming ``W``. Returns False, and stores nothing, when no ``I``
    is running or ``weight`` is not a leaf that requires grad; the layer then computes the
    gradient itself, now. ``weight`` must be the parameter object itself (keep it on ``ctx`` at
    forward): a tensor from ``ctx.saved_tensors`` may be another object (activation recompute
    returns one), and the gradient ``W`` hands to it would not reach the parameter."""
    store = _current("store")
    if store is None or not weight.requires_grad:
        return False
    store.add(weight, compute)
    return True


def weight_grad_deferred(param: torch.Tensor) -> bool:
    """True while an ``I`` runs that left ``param``'s gradient for its ``W``: a post-accumulate
    hook that fires now sees only the part computed at ``I``, and must wait for ``W``."""
    store = _current("store")
    return store is not None and store.holds(param)
