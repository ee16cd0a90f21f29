"""Data-parallel wrapper of one model chunk.

Gradients accumulate over the microbatches of an iteration and are summed over the
data-parallel (x context-parallel) group once, when grads are finalised. The loss is a token sum
(see ``grads.finalize_model_grads``), so the reduction is a plain sum: no 1/dp pre-scaling.
"""

from __future__ import annotations

import contextlib

import torch

from . import comm


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, config, parallel):
        super().__init__()
        self.module = module
        self.config = config
        self.parallel = parallel
        self._sync_enabled = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Suppress grad sync for microbatches before the last one of the iteration."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Nothing to start early: the plain wrapper reduces everything in finish_grad_sync."""

    def finish_grad_sync(self) -> None:
        group = self.parallel.dp_cp_group
        if comm.group_size(group) == 1:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)
