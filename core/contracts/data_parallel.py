"""What a data-parallel wrapper gives the core: the chunk protocol and its memory count.

A data-parallel wrapper plugin (entry-point group ``plugtron.data_parallel``; built-in ``ddp``
and ``fsdp2``) implements hook ``wrap_model_chunk`` and returns, for each model chunk, an object
that follows :class:`DataParallelChunk`. The core, the schedules and the optimizers reach data
parallelism only through these members, so a third party's wrapper (another FSDP, a
compressed all-reduce) is a drop-in.

How a wrapper answers the questions every run asks:

* **Gradients.** After ``finish_grad_sync()`` each parameter's gradient (``main_grad`` when the
  wrapper keeps one, else ``.grad``) holds the SUM over the data-parallel group (dp x cp; expert
  parameters, ``allreduce = False``: the expert data-parallel group), never the mean: the core
  divides by the global token count through ``scale_grads``.
* **Sharded gradients and parameters.** A wrapper that shards them over data parallelism keeps
  them as DTensors (``torch.distributed.tensor``) and names the groups its shards span in
  :attr:`DataParallelChunk.grad_shard_groups`: the grad norm, the zero count and the loss
  scaler's inf check read each rank's local shard (``plugtron.api.local_tensor``) and sum over
  those groups, so every element counts once.
* **The optimizer** sees the parameters the chunk's module holds: DTensors under a sharding
  wrapper. An optimizer plugin that can step them answers hook
  ``optimizer_takes_dtensor_params`` with True.
* **Checkpoints** stay layout-free: a DTensor is gathered over its data-parallel mesh when
  saved and this rank's shard is cut from the full tensor when loaded (core/checkpoint), so a
  run saved under one wrapper resumes under another.
* **The estimate** asks hook ``data_parallel_memory`` (:class:`DataParallelMemory`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class DataParallelChunk(Protocol):
    """One model chunk wrapped for data parallelism (what ``wrap_model_chunk`` returns)."""

    #: The wrapped model chunk (parameter names are read from it: global, layout-free).
    module: torch.nn.Module
    #: True when gradients live in sharded flat buffers that a sharding optimizer reaches
    #: through ``optimizer_shards()`` (``ddp`` under ``distributed-adam``); False otherwise.
    sharded: bool
    #: ``(dense groups, expert groups)`` over which parameters and gradients are sharded as
    #: DTensors: a norm over local shards is summed over them. ``((), ())`` when every rank
    #: holds whole tensors.
    grad_shard_groups: tuple[tuple[Any, ...], tuple[Any, ...]]
    #: Whether a split backward (``I`` then ``W``) may leave weight gradients for ``W``. A
    #: wrapper that reduces gradients inside autograd's hooks says False: the executor then
    #: computes every gradient at ``I`` (exact; the ``W`` has nothing left to do).
    defers_weight_grads: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any:
        """Back to training mode after an evaluation (``torch.nn.Module.train``)."""

    def eval(self) -> Any:
        """Evaluation mode (dropout off) before the validation passes (``torch.nn.Module``)."""

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hand the stage input (pipeline stages after the first) to the wrapped module."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside do not finish the gradient reduction (all but each chunk's last
        backward of an iteration run inside)."""

    def start_grad_sync(self) -> None:
        """Start every reduction not started yet (may return before it completes)."""

    def finish_grad_sync(self) -> None:
        """Wait for every reduction: afterwards the gradients hold the group's sum."""

    def scale_grads(self, factor: float) -> None:
        """Multiply every (reduced) gradient by ``factor``."""

    def zero_grad_buffer(self) -> None:
        """Zero the gradients before an iteration's first backward."""

    def start_param_sync(self, force_sync: bool = False) -> None:
        """After the optimizer step: bring updated parameters to every rank that computes with
        them (a no-op where the forward gathers them itself)."""

    def finish_param_sync(self) -> None:
        """Wait for parameter gathers in flight (before parameters are read outside a
        forward)."""


@dataclass
class DataParallelMemory:
    """Bytes one rank holds for its parameters, gradients and optimizer state under a
    wrapper (``plugtron estimate``); the activations are counted by the core."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    #: Parameters and gradients gathered for compute at the peak (a sharding wrapper's units
    #: in flight); 0 where every rank holds whole tensors anyway.
    gathered_bytes: int = 0
    #: One line the estimate prints under its table (how the wrapper counted), or "".
    note: str = ""
