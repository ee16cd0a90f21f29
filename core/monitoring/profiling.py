"""``--profile``: a torch profiler trace of steps A..B on the chosen ranks (Megatron's flags),
written as Chrome trace JSON that Perfetto and chrome://tracing open."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

import torch
from plugtron.core.errors import ConfigError


class StepProfiler:
    """Call :meth:`before_step` and :meth:`after_step` around every iteration."""

    def __init__(self, config, rank: int):
        log = config.logging
        self.enabled = bool(log.profile) and rank in profile_ranks(config)
        self.start, self.end = log.profile_step_start, log.profile_step_end
        self.path = os.path.join(log.profile_dir, f"rank{rank}.trace.json")
        self.profiler: torch.profiler.profile | None = None

    def before_step(self, iteration: int) -> None:
        if self.enabled and iteration == self.start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            with _without_tracer_chatter():
                self.profiler.__enter__()

    def after_step(self, iteration: int) -> None:
        if self.profiler is not None and iteration >= self.end:
            self.finish()

    def finish(self) -> None:
        """Stop and write the trace (also when the run ends before the last profiled step)."""
        if self.profiler is None:
            return
        with _without_tracer_chatter():
            self.profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.profiler.export_chrome_trace(self.path)
        self.profiler = None
        print(f"profile of steps {self.start}-{self.end} written to {self.path} (open it in "
              f"https://ui.perfetto.dev or chrome://tracing)", flush=True)


#: What torch's tracer (kineto) writes to the process's stderr at every start and stop, whatever
#: its log level: ``USDT: ... profiler_start``, ``STAGE: ... Completed Stage: Warm Up``.
_CHATTER = re.compile(rb"^(USDT|STAGE):")


@contextlib.contextmanager
def _without_tracer_chatter():
    """Native stderr captured around a profiler start or stop; every line but the tracer's
    chatter is written back, so a real error still shows."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield  # no file descriptor 2 to capture (an embedding host): leave it alone
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True)
                    if not _CHATTER.match(line)]
            if kept:
                os.write(2, b"".join(kept))


def profile_ranks(config) -> list[int]:
    try:
        return [int(r) for r in config.logging.profile_ranks]
    except (TypeError, ValueError):
        raise ConfigError(f"--profile-ranks takes rank numbers, got "
                          f"{config.logging.profile_ranks!r}") from None


def validate_profile(config) -> None:
    log = config.logging
    if not log.profile:
        return
    if not 1 <= log.profile_step_start <= log.profile_step_end:
        raise ConfigError(f"need 1 <= --profile-step-start ({log.profile_step_start}) <= "
                          f"--profile-step-end ({log.profile_step_end})")
    profile_ranks(config)
