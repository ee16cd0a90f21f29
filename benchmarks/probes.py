"""What several benchmarks measure the same way: the peak of live tensor bytes under
torch.profiler, and each training step's time through the step-end hook."""

from __future__ import annotations

from plugtron.api import hookimpl


def live_peak_bytes(prof) -> int:
    """The most bytes of torch allocations alive at once during a ``torch.profiler.profile(...,
    profile_memory=True)`` over those alive when it started (its memory events, in time
    order)."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


class StepTimes:
    """An extension that keeps every step's ``step_time_s`` (pass it in ``extra_plugins``)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        self.times.append(metrics["step_time_s"])
