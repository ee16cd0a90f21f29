"""Where the run is, for error messages raised deep inside plugins (e.g. a NaN loss).

The training loop updates it; plugins only read it. One process runs one rank, so a module-level
record is that rank's record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from plugtron.core.errors import PlugtronError


@dataclass
class StepInfo:
    iteration: int = 0
    rank: int = 0
    #: Set under --rerun-mode validate_results: a non-finite loss is validated (and the step
    #: re-run) after the backward (core/training/rerun.py), not raised inside the loss function.
    defer_nonfinite: bool = False


current = StepInfo()


class NonFiniteLossError(PlugtronError):
    """The loss became NaN or Inf."""


def check_finite(value: torch.Tensor, what: str = "loss") -> None:
    """Raise before any reduction across ranks, naming iteration and rank (unless the run
    validates its steps' results itself: ``defer_nonfinite``)."""
    if current.defer_nonfinite:
        return
    number = float(value.detach().float().sum())
    if not math.isfinite(number):
        raise NonFiniteLossError(f"{what} is {number} at iteration {current.iteration} on rank "
                                 f"{current.rank}; lower --lr or check the data")
