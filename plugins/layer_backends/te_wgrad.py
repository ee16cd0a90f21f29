"""transformer-engine's delayed weight gradients under plugtron's split backward (``I`` + ``W``).

A ``te.Linear`` built with ``delay_wgrad_compute=True`` has a ``wgrad_store``: while the store
is switched on, TE's backward returns the input gradient and queues its weight-gradient GEMM
(with the input and output gradient it needs) instead of running it; ``store.pop()`` runs the
oldest queued GEMM and returns ``(wgrad, bgrad)`` (older releases: a longer tuple, same first
two). TE's own ``backward_dw`` would pop and *assign* ``.grad``: no accumulation over
microbatches and no autograd hooks, so plugtron's data-parallel buffers would miss it. Here the
pop goes to plugtron instead: the ``I`` hands a closure that pops to ``defer_weight_grad``, and
the ``W`` passes the gradient to autograd like every deferred weight of the local backend.
(TE's constructor also marks the parameters ``skip_backward_post_hook``, for Megatron-Core's
data-parallel wrapper; plugtron's do not read it: the ``W`` runs their hooks through autograd.)

When the store is on. It is off by default. It is on for the forward of a microbatch whose
backward is split (TE 2.16 on queues only for a forward that ran with the store on) and again
for that call's own backward (every release checks the store when its backward runs; 2.3 to
2.15 only then); two identity autograd functions around the TE call open and close that
backward window. Any other forward, and any other backward, computes its weight gradient at
once, as before.

Order. TE's queue is first in, first out per module, so a ``W`` must pop its own entry: each
queued entry gets a ticket, and a ``W`` whose ticket is not at the head raises (plugtron's
schedules run a chunk's ``W``'s in the order of their ``I``'s).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
from plugtron.api import defer_weight_grad, split_backward_expected

#: What plugtron calls on TE's store (all of them exist since delayed wgrad came, in TE 2.3).
_STORE_METHODS = ("delay_wgrad_compute", "enable_delay_wgrad_compute",
                  "disable_delay_wgrad_compute", "put", "pop")


def cannot_delay_reason(te) -> str | None:
    """Why this transformer-engine's ``Linear`` cannot delay its weight gradients per
    microbatch (``None``: it can). Read from the constructor's signature and from the store
    class its module builds, never from a version number."""
    if "delay_wgrad_compute" not in inspect.signature(te.Linear.__init__).parameters:
        return ("this transformer-engine's Linear has no delay_wgrad_compute (transformer-engine "
                "2.3 or later has it): its backward computes the weight gradients")
    store_class = getattr(sys.modules.get(te.Linear.__module__), "WeightGradStore", None)
    if not all(callable(getattr(store_class, name, None)) for name in _STORE_METHODS):
        return ("this transformer-engine's weight-gradient store cannot be switched on and off "
                "per microbatch: its backward computes the weight gradients")
    return None


class DelayedWeightGrads:
    """One ``te.Linear``'s delayed weight gradients: its store, switched on only for split
    microbatches, and the tickets of the entries queued in it."""

    def __init__(self, store, layer_name: str) -> None:
        self.store = store
        self.layer_name = layer_name
        # TE's constructor leaves the store on; combined backwards must not queue anything.
        store.disable_delay_wgrad_compute()
        self.tickets: collections.deque[int] = collections.deque()
        self.issued = 0

    def run(self, forward: Callable, x: torch.Tensor, weight: torch.Tensor,
            gemm_bias: torch.Tensor | None):
        """``forward(x)`` (TE's forward: a tensor, or ``(out, bias)`` with ``return_bias``); in
        the forward of a split microbatch, its weight gradient (and the bias gradient that TE
        fuses into the same GEMM: ``gemm_bias``) goes to ``W``."""
        if not (split_backward_expected() and torch.is_grad_enabled() and x.requires_grad
                and weight.requires_grad):
            return forward(x)
        call = _Call(self, weight,
                     gemm_bias if gemm_bias is not None and gemm_bias.requires_grad else None)
        x = _AfterTEBackward.apply(x, weight, call.bias, call)
        with self.delaying():
            out = forward(x)
        if isinstance(out, tuple):
            return (_BeforeTEBackward.apply(out[0], call), *out[1:])
        return _BeforeTEBackward.apply(out, call)

    @contextlib.contextmanager
    def delaying(self) -> Iterator[None]:
        """The store on, and back as it was after (a recomputed forward may run while a
        backward window is open)."""
        was_on = self.store.delay_wgrad_compute()
        self.store.enable_delay_wgrad_compute()
        try:
            yield
        finally:
            if not was_on:
                self.store.disable_delay_wgrad_compute()

    def queued(self) -> int:
        return self.store.context.qsize()

    def take_ticket(self) -> int:
        self.issued += 1
        self.tickets.append(self.issued)
        return self.issued

    def pop(self, ticket: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the queued GEMM of ``ticket``: ``(wgrad, bgrad)`` (``bgrad`` None where TE
        computed the bias gradient at ``I``, as under fp8)."""
        if not self.tickets or self.tickets[0] != ticket:
            raise RuntimeError(
                f"{self.layer_name}: transformer-engine queues its delayed weight gradients "
                f"first in, first out, but this W (entry {ticket}) is not the oldest one queued "
                f"({list(self.tickets)}): a schedule must run one chunk's W's in the order of "
                f"their I's under --layer-backend te")
        self.tickets.popleft()
        with self.delaying():  # TE pops only while its store is on
            result, _ = self.store.pop()
        return result[0], result[1]


class _Call:
    """One split call of the layer: opens and closes its backward window, and pops its queued
    GEMM once for the weight and the bias."""

    def __init__(self, delayed: DelayedWeightGrads, weight, bias) -> None:
        self.delayed, self.weight, self.bias = delayed, weight, bias
        self.window: contextlib.ExitStack | None = None
        self.queued_before = 0
        self.ticket = 0
        self.grads: dict[str, torch.Tensor | None] | None = None

    def open(self) -> None:
        """Right before TE's backward: the store on, so that TE queues its GEMM."""
        self.queued_before = self.delayed.queued()
        self.window = contextlib.ExitStack()
        self.window.enter_context(self.delayed.delaying())

    def close(self) -> bool:
        """Right after TE's backward: the store back off. True when TE queued this call's
        GEMM (it did not where the weight needed no gradient)."""
        assert self.window is not None, "TE's backward ran without its window"
        self.window.close()
        self.window = None
        added = self.delayed.queued() - self.queued_before
        if added not in (0, 1):
            raise RuntimeError(f"{self.delayed.layer_name}: transformer-engine queued {added} "
                               f"weight-gradient GEMMs in one backward, expected one")
        if added:
            self.ticket = self.delayed.take_ticket()
        return bool(added)

    def _grad(self, key: str) -> torch.Tensor | None:
        if self.grads is None:
            wgrad, bgrad = self.delayed.pop(self.ticket)
            self.grads = {"weight": wgrad.to(self.weight.dtype)}
            if self.bias is not None:
                # Under fp8 TE returned the bias gradient at I and its GEMM gives none: W then
                # adds zero, which leaves the sum exact.
                self.grads["bias"] = (torch.zeros_like(self.bias) if bgrad is None
                                      else bgrad.to(self.bias.dtype))
        grad = self.grads.pop(key)
        if not self.grads:
            self.weight = self.bias = None  # nothing left to hand over: drop the references
        return grad

    def weight_grad(self) -> torch.Tensor | None:
        return self._grad("weight")

    def bias_grad(self) -> torch.Tensor | None:
        return self._grad("bias")


class _BeforeTEBackward(torch.autograd.Function):
    """Identity on TE's output; its backward runs right before TE's and opens the window."""

    @staticmethod
    def forward(ctx, out, call):
        ctx.call = call
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.call.open()
        return grad, None


class _AfterTEBackward(torch.autograd.Function):
    """Identity on TE's input; its backward runs right after TE's, closes the window and hands
    the queued GEMM to plugtron's ``W`` (or, where no ``I`` collects, runs it now and returns
    the gradients through autograd). Weight and bias are inputs so that those can flow."""

    @staticmethod
    def forward(ctx, x, weight, bias, call):
        ctx.call = call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        call = ctx.call
        if not call.close():
            return grad_x, None, None, None
        if defer_weight_grad(call.weight, call.weight_grad):
            # The same store takes the bias: it requires grad (checked at forward).
            if call.bias is not None and not defer_weight_grad(call.bias, call.bias_grad):
                raise RuntimeError(f"{call.delayed.layer_name}: the bias gradient of a "
                                   f"deferred weight gradient was not deferred")
            return grad_x, None, None, None
        weight_grad = call.weight_grad()
        bias_grad = call.bias_grad() if call.bias is not None else None
        return grad_x, weight_grad, bias_grad, None
