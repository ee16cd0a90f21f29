"""Losses from inside the model: a layer adds a named loss term that enters backward on the
layer's own pipeline stage (MoE load balancing, z-loss, multi-token prediction, ...).

The run's objective is ``sum(loss_sum over microbatches and ranks) / N`` with ``N`` the global
number of counted tokens (``finalize_model_grads`` divides every gradient by ``N``). An added term
counts like a per-token loss of its microbatch: microbatch ``m`` with ``n_m`` counted tokens
contributes ``n_m * value_m / N``, i.e. the token-weighted mean of the term over the global
batch, which is the per-microbatch mean when microbatches hold equal token counts (Megatron's
default normalisation of its aux losses). So the term's gradient is the same under every
pipeline, data-parallel and microbatch layout of the same global batch.

How it enters backward without any schedule knowing: :func:`add_loss` returns the layer's output
through an autograd function whose backward passes the output gradient on and also starts the
term's own backward, scaled by ``loss_scale x n_m`` (Megatron's ``MoEAuxLossAutoScaler`` trick).
``n_m`` is the loss-mask sum of the microbatch that ``forward_step`` drew last (the core's data
iterators record it); ``loss_scale`` is the fp16 scale of this step.

Reports: each name is summed over the layers that add it, reduced over data-parallel and pipeline
ranks, and logged as ``name`` in the metrics (the token-weighted mean defined above).
"""

from __future__ import annotations

import torch
from plugtron.core.training.recompute import is_recomputing

# ``tokens`` stays a tensor (on the batch's device): reading it as a number here would be a
# host sync per microbatch on CUDA; it becomes a number only in the step's report.
_state = {"tokens": 0.0, "loss_scale": 1.0}
_totals: dict[str, torch.Tensor] = {}


def note_microbatch(batch: dict) -> None:
    """Called by the core's data iterators for every microbatch drawn."""
    mask = batch.get("loss_mask") if isinstance(batch, dict) else None
    _state["tokens"] = mask.detach().sum().float() if mask is not None else 0.0


def set_loss_scale(scale: float) -> None:
    _state["loss_scale"] = float(scale)


def take() -> dict[str, torch.Tensor]:
    """This rank's ``{name: sum of n_m x value_m}`` since the last call, and reset."""
    out = dict(_totals)
    _totals.clear()
    return out


class _InjectLossGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, loss, weight):
        ctx.save_for_backward(loss)
        ctx.weight = weight
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_hidden):
        (loss,) = ctx.saved_tensors
        # ``weight`` may be a 0-dim tensor (the token count): multiply, no host read.
        return grad_hidden, torch.ones_like(loss) * ctx.weight, None


def add_loss(hidden: torch.Tensor, name: str, loss: torch.Tensor) -> torch.Tensor:
    """Add the scalar ``loss`` to the objective under ``name``; use the returned tensor in place
    of ``hidden`` (the layer's output) so the term's backward runs when the output's does.

    Works on any pipeline stage and in evaluation (then only reported)."""
    if loss.dim() != 0:
        raise ValueError(f"add_loss({name!r}): the loss must be a scalar, got shape "
                         f"{tuple(loss.shape)}")
    tokens = _state["tokens"]
    if not is_recomputing():  # a recomputed forward must not report the term a second time
        value = loss.detach().float() * tokens
        _totals[name] = _totals[name] + value if name in _totals else value
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return hidden
    return _InjectLossGrad.apply(hidden, loss, _state["loss_scale"] * tokens)


def recording(iterator):
    """Wrap a microbatch iterator so each drawn microbatch sets the token weight."""
    for batch in iterator:
        note_microbatch(batch)
        yield batch
