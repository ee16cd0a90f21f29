"""``--rerun-mode validate_results`` (Megatron's flag): a step whose result looks wrong is run
again, once, before the optimizer step, on the same microbatches from the same RNG state, and
the comparison tells a fault of the machine from a property of the data or the model.

What is validated, after the forward and backward of every microbatch and the gradient
reduction, before the optimizer step:

- the main loss (reduced over the data-parallel ranks and the pipeline) is NaN or Inf;
- ``--check-for-spiky-loss``: the main loss exceeds ``--spiky-loss-factor`` (default 10, the
  factor Megatron's GPT uses) times the largest loss of the run's first 100 accepted steps (the
  reference Megatron's ``is_unexpectedly_large`` keeps);
- a gradient holds NaN or Inf (not under ``--fp16``, whose loss scaler owns overflows).

Every rank agrees on the verdict (one all-reduce of two numbers per step). When a check fails,
gradients are zeroed, the RNG states (core/parallel/random.py) restored, and the schedule runs
again on the recorded microbatches. The re-run's result is compared with the first, bit for bit
(Megatron's default tolerance 0):

- **transient** (the re-run passes, or differs): a fault of the hardware (or of something else
  that does not repeat). Training continues with the re-run's gradients, as in Megatron.
- **reproducible** (the same result again): a property of the data or of the model. A
  non-finite loss or gradient stops the run with an error (no optimizer step: the weights and
  the last checkpoint stay clean); a reproducible spike is reported and training continues
  (Megatron's spiky-loss check is not fatal).

Megatron's third step, a checkpoint and a restart that re-runs the step on a different GPU
(exit code 16) to tell a persistent hardware fault from a correct result, is not done: plugtron
stops (or continues) after the re-run in place. ``report_stats`` is refused.
"""

from __future__ import annotations

import math

import torch
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.random import get_rng_state, set_rng_state
from plugtron.core.training import grads as grad_utils
from plugtron.core.training import step_info

MODES = ("disabled", "validate_results", "report_stats")
#: Steps whose main loss sets the spike reference (Megatron's ``num_samples``).
SPIKE_SAMPLES = 100
#: Record keys a validated step adds when it was re-run (its console line:
#: core/monitoring/metrics.py: rerun_line).
KEYS = ("rerun", "rerun_reason")


def validate_rerun(config) -> None:
    t = config.training
    if t.rerun_mode == "report_stats":
        raise ConfigError("--rerun-mode report_stats (re-run every step and report the "
                          "differences) is not implemented; use validate_results or disabled")
    if t.rerun_mode not in MODES:
        raise ConfigError(f"--rerun-mode {t.rerun_mode!r}: choose one of {', '.join(MODES)}")
    if not t.spiky_loss_factor > 1:
        raise ConfigError(f"--spiky-loss-factor must be > 1, got {t.spiky_loss_factor}")


class ReplayIterator:
    """Keeps the microbatches drawn during one step so that the step can draw them again."""

    def __init__(self, source):
        self.source = source
        self.drawn: list = []
        self.replay: list | None = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.replay:
            return self.replay.pop(0)
        item = next(self.source)
        self.drawn.append(item)
        return item

    def start_step(self) -> None:
        self.drawn, self.replay = [], None

    def rewind(self) -> None:
        self.replay = list(self.drawn)

    def __getattr__(self, name):  # e.g. TimedIterator.take_wait
        return getattr(self.source, name)


class RerunStateMachine:
    """One per run: :meth:`start_step` before the step, :meth:`verdict` after its backward."""

    def __init__(self, config, parallel, tracker=None):
        t = config.training
        self.enabled = t.rerun_mode == "validate_results"
        self.check_spikes = bool(t.check_for_spiky_loss)
        self.factor = float(t.spiky_loss_factor)
        self.check_grads = not t.fp16
        self.parallel = parallel
        self.tracker = tracker
        self.iterators: list[ReplayIterator] = []
        self.reference: float | None = None
        self.samples = 0
        self.rng = None
        self.first: tuple | None = None
        self.report: dict = {}
        self.error: str | None = None

    def wrap(self, iterator):
        if not self.enabled:
            return iterator
        replay = ReplayIterator(iterator)
        self.iterators.append(replay)
        return replay

    def start_step(self) -> None:
        self.report, self.first, self.error = {}, None, None
        if self.enabled:
            self.rng = get_rng_state(self.tracker)
            for it in self.iterators:
                it.start_step()
            # The loss function's own NaN check (step_info.check_finite) would end the step on
            # one rank; the step's result is validated, and re-run, after the backward instead.
            step_info.current.defer_nonfinite = True

    def end_step(self) -> None:
        step_info.current.defer_nonfinite = False

    def _problem(self, loss: float | None, model_chunks) -> tuple[str, bool, tuple] | None:
        """(reason, fatal, result) of a failed check on this rank, or None."""
        grads_bad = self.check_grads and not _grads_finite(model_chunks)
        flags = torch.tensor([0.0 if loss is None or math.isfinite(loss) else 1.0,
                              float(grads_bad)], dtype=torch.float64)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            device = next((p.device for c in model_chunks for p in c.parameters()), None)
            flags = flags.to(device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            flags = flags.cpu()
        if flags[0] > 0:
            return f"loss is {loss}", True, ("loss", _key(loss))
        if flags[1] > 0:
            return "a gradient is NaN or Inf", True, ("grad", "non-finite")
        if (self.check_spikes and loss is not None and self.reference is not None
                and abs(loss) > self.factor * self.reference):
            return (f"loss {loss:.6g} is over {self.factor:g} x {self.reference:.6g} (the "
                    f"largest of the first {self.samples} steps)"), False, ("loss", loss)
        return None

    def verdict(self, loss: float | None, model_chunks) -> bool:
        """Whether to run the step again (then the RNG and the data are rewound). After the
        re-run, :attr:`error` is set (on every rank) when the step must not be taken: a
        non-finite loss or gradient again; :meth:`stop` then raises it."""
        if not self.enabled:
            return False
        problem = self._problem(loss, model_chunks)
        if self.first is None:  # the first run of this step
            if problem is None:
                self._accept(loss)
                return False
            self.first = problem
            set_rng_state(self.rng, self.tracker)
            for it in self.iterators:
                it.rewind()
            return True
        reason, fatal, result = self.first
        reproducible = problem is not None and problem[2] == result
        self.report = {"rerun": "reproducible" if reproducible else "transient",
                       "rerun_reason": reason}
        if reproducible and fatal:
            self.error = (f"{reason} at iteration {step_info.current.iteration}, again when the "
                          f"step was re-run on the same data from the same RNG state "
                          f"(--rerun-mode validate_results): reproducible, a problem of the data "
                          f"or the model, not a hardware fault; no optimizer step was taken. "
                          f"Lower --lr or check the data")
        elif problem is not None and problem[1]:  # the re-run failed too, differently
            self.error = (f"{reason} at iteration {step_info.current.iteration}; re-run on the "
                          f"same data (--rerun-mode validate_results): {problem[0]}; no "
                          f"optimizer step was taken")
        if problem is None:
            self._accept(loss)
        return False

    def _accept(self, loss: float | None) -> None:
        if loss is not None and math.isfinite(loss) and self.samples < SPIKE_SAMPLES:
            self.reference = max(abs(loss), self.reference or 0.0)
            self.samples += 1


    def stop(self) -> None:
        """After the step's record is written: end the run when the re-run confirmed a
        non-finite result."""
        if self.error is not None:
            raise step_info.NonFiniteLossError(self.error)


def _key(value: float | None):
    """Non-finite values compare by kind (NaN equals NaN here)."""
    return "nan" if value is not None and math.isnan(value) else value


def _grads_finite(model_chunks) -> bool:
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = grad_utils.local_grad_of(param)
            if grad is not None and not bool(torch.isfinite(grad).all()):
                return False
    return True


class NonFiniteSteps:
    """``--check-for-nan-in-loss-and-grad`` (on by default) outside ``--rerun-mode``: the
    optimizer does not apply a step whose global gradient norm is NaN or Inf
    (``StepResult.nonfinite``), and this stops the run at that iteration, or counts it as a
    skip while ``--skip-nonfinite-steps`` allows more. The last checkpoint stays the last."""

    def __init__(self, config):
        self.allowed = config.training.skip_nonfinite_steps
        self.skipped = 0

    def record(self, iteration: int, result, losses: dict) -> dict:
        """Metrics for this step's record; raises once the skips run out."""
        if not result.nonfinite:
            return {"nonfinite_skips": self.skipped} if self.skipped else {}
        self.skipped += 1
        if self.skipped > self.allowed:
            loss = ", ".join(f"{k} {float(v):.4g}" for k, v in losses.items()) or "no loss"
            skips = (f" (the {self.skipped}th such step; --skip-nonfinite-steps allows "
                     f"{self.allowed})" if self.allowed else "")
            raise step_info.NonFiniteLossError(
                f"iteration {iteration}: the gradient norm is {result.grad_norm} ({loss}), so "
                f"the step was not applied and the run stops{skips}; the weights and the last "
                f"checkpoint are those before it. Lower --lr or clip gradients (--clip-grad), "
                f"use --rerun-mode validate_results to tell a transient fault from a "
                f"reproducible one, or --skip-nonfinite-steps N to skip a few such steps")
        return {"nonfinite_skips": self.skipped}

