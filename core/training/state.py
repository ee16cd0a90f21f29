"""Where training stands: what a checkpoint resumes and what the lifecycle hooks are told."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Iterations done and samples consumed so far (the sampler resumes from the latter)."""

    iteration: int = 0
    consumed_samples: int = 0
