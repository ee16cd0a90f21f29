"""``--log-straggler`` (Megatron's flag): every ``--log-interval`` iterations, each rank's time in
the step's forward and backward passes, gathered over the world, so that a slow rank is named.

What is timed is the schedule (forward and backward of every microbatch on this rank's stages),
averaged over the iterations since the last report: the gradient reduction over data-parallel
ranks and the optimizer step are left out, because there every rank waits for the slowest one
and the straggler would look the fastest. Under tp, cp or pp the schedule's own
communication (and its waits) is inside the timed part, so the figures there tell a slow stage
or group apart rather than one rank. One float per rank, gathered only at the log interval.
"""

from __future__ import annotations

import torch
from plugtron.core.errors import ConfigError

#: The keys a report adds to the iteration's metrics record.
KEYS = ("straggler_min_s", "straggler_min_rank", "straggler_max_s", "straggler_max_rank")


def validate_straggler(config) -> None:
    if config.logging.log_straggler and config.training.log_interval < 1:
        raise ConfigError(f"--log-straggler reports every --log-interval iterations; give "
                          f"--log-interval N >= 1 (got {config.training.log_interval})")


class StragglerLog:
    """Call :meth:`add` with this rank's forward-backward time after every step and
    :meth:`report` (every rank, a collective when due) after it; ``report`` returns the record
    entries to add, or ``{}``."""

    def __init__(self, config, device: torch.device):
        self.enabled = bool(config.logging.log_straggler)
        self.interval = config.training.log_interval
        self.device = device
        self.seconds = 0.0
        self.steps = 0

    def add(self, seconds: float) -> None:
        if self.enabled:
            self.seconds += seconds
            self.steps += 1

    def report(self, iteration: int) -> dict:
        if not self.enabled or self.interval < 1 or iteration % self.interval:
            return {}
        mine = torch.tensor([self.seconds / max(self.steps, 1)], dtype=torch.float64,
                            device=self.device)
        self.seconds, self.steps = 0.0, 0
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            times = torch.empty(torch.distributed.get_world_size(), dtype=torch.float64,
                                device=self.device)
            torch.distributed.all_gather_into_tensor(times, mine)
        else:
            times = mine
        times = times.cpu()
        low, high = int(times.argmin()), int(times.argmax())
        return {"straggler_min_s": float(times[low]), "straggler_min_rank": low,
                "straggler_max_s": float(times[high]), "straggler_max_rank": high}


def console_line(record: dict) -> str:
    return (f"straggler at iteration {record['iteration']} | forward-backward time min "
            f"{record['straggler_min_s'] * 1000:.1f} ms (rank {record['straggler_min_rank']}) | "
            f"max {record['straggler_max_s'] * 1000:.1f} ms (rank {record['straggler_max_rank']})")
