"""Pieces every schedule shares: one forward step on one chunk, one backward step, and the
bookkeeping of reports and tokens. Third-party schedules use these too."""

from __future__ import annotations

import contextlib

import torch


def forward_step(forward_step_func, data_iterator, model_chunk, input_tensor, is_last_stage: bool,
                 forward_only: bool, reports: list) -> torch.Tensor:
    """Run one microbatch forward on one chunk.

    On stages after the first the input arrives through ``set_input_tensor``. On the last stage
    the loss closure runs and its report (with ``num_tokens``) is appended to ``reports``; the
    returned tensor is then the loss sum that backward starts from.
    """
    if input_tensor is not None:
        model_chunk.set_input_tensor(input_tensor)
    context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with context:
        output, loss_closure = forward_step_func(data_iterator, model_chunk)
        if is_last_stage:
            loss_sum, num_tokens, report = loss_closure(output)
            report = dict(report)
            report["num_tokens"] = num_tokens.detach().reshape(())
            reports.append(report)
            output = loss_sum
    return output


def backward_step(output_tensor, output_grad: torch.Tensor | None,
                  input_tensor: torch.Tensor | None, loss_scale: float = 1.0):
    """Backward from the loss (last stage, scaled) or from the received output gradient;
    returns the gradient of the stage input for the previous stage (or None).

    ``output_tensor`` may be a ``torch.autograd.graph.GradientEdge`` of the output instead of
    the output itself, so that a schedule can free a sent activation and keep only its graph.
    """
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_grad is None:
        output_tensor = output_tensor * loss_scale if loss_scale != 1.0 else output_tensor
    torch.autograd.backward(output_tensor, grad_tensors=output_grad)
    return input_tensor.grad if input_tensor is not None else None


def sync_context(model_chunk, is_last_microbatch: bool):
    """Grad sync happens only on the last microbatch of a chunk (no_sync for the others)."""
    if is_last_microbatch or not hasattr(model_chunk, "no_sync"):
        return contextlib.nullcontext()
    return model_chunk.no_sync()
