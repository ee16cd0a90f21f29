"""fp16 dynamic loss scaling (Megatron's DynamicGradScaler) and the unscale-and-check step.

The schedule multiplies the loss by ``scale`` before backward so that small fp16 gradients do not
flush to zero; the optimizer divides the gradients by it again and, if any is inf/nan on any rank,
skips the step. ``hysteresis`` overflows in a row are tolerated before the scale is multiplied by
``backoff_factor``; after ``growth_interval`` clean steps it is multiplied by ``growth_factor``.
"""

from __future__ import annotations

import torch
from plugtron.core.parallel import comm

GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5


class DynamicLossScaler:
    def __init__(self, initial_scale: float, min_scale: float = 1.0,
                 growth_interval: int = 1000, hysteresis: int = 2,
                 growth_factor: float = GROWTH_FACTOR, backoff_factor: float = BACKOFF_FACTOR):
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError(f"loss scales must be positive (initial {initial_scale}, "
                             f"min {min_scale})")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth interval ({growth_interval}) and hysteresis "
                             f"({hysteresis}) must be at least 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @classmethod
    def from_config(cls, config) -> DynamicLossScaler:
        t = config.training
        return cls(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        """JSON-ready scalars."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def unscale_and_check(grads: list[torch.Tensor], scale: float, groups=()) -> bool:
    """Divide ``grads`` by ``scale`` in place; True if any is inf/nan on any rank of ``groups``
    (max-reduced over each in turn, so every rank takes the same decision)."""
    # On the grads' device: nccl reduces device tensors only.
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for tensors in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)
    for group in groups:
        comm.all_reduce(found, group, op=comm.MAX)
    return bool(found.item() > 0)
