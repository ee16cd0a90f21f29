"""The loss closure a model's ``forward_step`` returns, so that the core calls ``loss_func``.

Megatron's ``forward_step`` returns ``partial(loss_func, loss_mask)`` and the schedule calls it:
the hook named ``loss_func`` is then never called through the plugin manager, and an extension
that wraps it never runs. ``plugtron.api.loss_closure(loss_mask)`` returns the same closure with
its inputs as data; the core binds it to the run's ``loss_func`` hook (with every wrapper), and
the schedule calls it as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from plugtron.core.contracts.versions import deprecated

if TYPE_CHECKING:
    import torch

    LossResult = tuple[torch.Tensor, torch.Tensor, dict]


@dataclass(frozen=True)
class LossClosure:
    """``loss_closure(output_tensor)`` -> ``loss_func(loss_mask, output_tensor)`` of the run."""

    loss_mask: torch.Tensor
    #: the run's ``pm.hook.loss_func``, set by the core (:meth:`bound`).
    hook: Callable[..., LossResult] | None = field(default=None, repr=False)

    def bound(self, hook: Callable[..., LossResult]) -> LossClosure:
        return replace(self, hook=hook)

    def __call__(self, output_tensor: torch.Tensor) -> LossResult:
        if self.hook is None:
            raise RuntimeError("a loss_closure is called through the run (the core binds it to "
                               "the loss_func hook); outside a run, call the model's loss_func "
                               "itself")
        return self.hook(loss_mask=self.loss_mask, output_tensor=output_tensor)


#: The run's ``loss_func`` hook while the core calls ``forward_step``: a closure made inside is
#: bound at once, so an extension wrapping ``forward_step`` can already call it.
_RUN_LOSS_FUNC: ContextVar[Callable | None] = ContextVar("plugtron_run_loss_func", default=None)


@contextlib.contextmanager
def run_loss_func(hook: Callable[..., LossResult]):
    """Inside: ``loss_closure`` binds to ``hook`` (the core wraps its ``forward_step`` call)."""
    token = _RUN_LOSS_FUNC.set(hook)
    try:
        yield
    finally:
        _RUN_LOSS_FUNC.reset(token)


def loss_closure(loss_mask: torch.Tensor) -> LossClosure:
    """What a model's ``forward_step`` returns beside its output: the run's ``loss_func`` hook
    over ``loss_mask`` and, on the last stage, the output."""
    return LossClosure(loss_mask, _RUN_LOSS_FUNC.get())


def bind_loss_closure(closure: Callable, loss_func: Callable[..., LossResult]) -> Callable:
    """``closure`` bound to the run's ``loss_func`` hook. A plain callable (contract 2's
    ``partial(loss_func, loss_mask)``) still works for contract 3, with a deprecation: the hook
    and its wrappers do not run for it."""
    if isinstance(closure, LossClosure):
        return closure if closure.hook is not None else closure.bound(loss_func)
    module = getattr(getattr(closure, "func", closure), "__module__", None) or "a model plugin"
    deprecated(f"{module}: forward_step returned a plain loss closure, so the run's loss_func "
               f"hook (and any extension wrapping it) is not called; return "
               f"plugtron.api.loss_closure(loss_mask) instead (contract 3; plain closures stop "
               f"working in contract 4)", module)
    return closure
