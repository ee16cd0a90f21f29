"""What a run tells its user: a progress bar and console lines on rank 0, and a JSON-lines
metrics file (one object per training iteration, per evaluation, and a final summary)."""

from __future__ import annotations

import json
import math
import sys
import time
import uuid

from tqdm import tqdm

from . import straggler

#: Keys of a re-run step's record (core/training/rerun.py; not imported: monitoring sits below
#: training).
RERUN_KEYS = ("rerun", "rerun_reason")


class MetricsLogger:
    #: Keys of a train record that are not losses (everything else a model reported is one).
    STEP_KEYS = ("iteration", "grad_norm", "lr", "tokens_per_sec", "step_time_s",
                 "data_time_s", "consumed_samples", "skipped", "num_zeros", "loss_scale", "memory_mb",
                 "max_attention_logit",
                 *straggler.KEYS, *RERUN_KEYS)

    def __init__(self, config, rank: int, start_iteration: int = 0, main_loss: str = "lm_loss"):
        self.config = config
        self.main_loss = main_loss
        self.enabled = rank == 0
        self.file = None
        self.bar = None
        self.run_id = uuid.uuid4().hex[:12]
        if not self.enabled:
            return
        path = config.logging.metrics_file
        if path:
            self.file = open(path, "a", buffering=1)
        if config.logging.progress and sys.stderr.isatty():

            self.bar = tqdm(total=config.training.train_iters, initial=start_iteration,
                            unit="it", dynamic_ncols=True, file=sys.stderr)

    def write(self, record: dict) -> None:
        # Strict JSON, one object per line: NaN/Inf become null; run_id tells runs apart.
        if self.file:
            line = json.dumps({**_finite(record), "run_id": self.run_id}, allow_nan=False)
            self.file.write(line + "\n")

    def started(self, iteration: int, restart: int) -> None:
        """Where a resumed or elastically restarted run started: one line in the metrics file
        (``{"resumed_from_iteration": N, "elastic_restart": K}``), so a reader sees where the
        iterations after N were done again. A fresh first start writes nothing."""
        if iteration or restart:
            self.write({"resumed_from_iteration": iteration, "elastic_restart": restart})

    def train_step(self, record: dict) -> None:
        if not self.enabled:
            return
        self.write(record)
        it = record["iteration"]
        if self.bar is not None:
            self.bar.update(it - self.bar.n)
            losses = {k: _number(v) for k, v in self.losses(record).items()}
            self.bar.set_postfix(**losses, lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_sec']:.0f}", refresh=False)
        interval = self.config.training.log_interval
        if self.bar is None and interval and (it % interval == 0 or it == 1):
            line = " | ".join(f"{k.replace('_', ' ')} {_number(v)}"
                              for k, v in self.losses(record).items())
            print(f"iteration {it:6d}/{self.config.training.train_iters} | {line} | "
                  f"grad norm {record['grad_norm']:.3f} | "
                  f"lr {record['lr']:.3e} | {record['tokens_per_sec']:.0f} tokens/s | "
                  f"{record['step_time_s'] * 1000:.0f} ms/step", flush=True)
        if "straggler_max_rank" in record:
            self._print(straggler.console_line(record))
        if "rerun" in record:
            self._print(rerun_line(record))

    def losses(self, record: dict) -> dict:
        """The loss entries of a record, the main loss first."""
        out = {k: v for k, v in record.items() if k not in self.STEP_KEYS}
        if self.main_loss in out:
            out = {self.main_loss: out.pop(self.main_loss), **out}
        return out

    def evaluation(self, record: dict) -> None:
        if not self.enabled:
            return
        self.write(record)
        losses = " | ".join(f"{k.replace('_', ' ')} {_number(v)}"
                            for k, v in record.items() if k != "iteration")
        self._print(f"validation at iteration {record['iteration']} | {losses}")

    def summary(self, record: dict) -> None:
        if not self.enabled:
            return
        self.write(record)
        self.close_bar()
        print("summary: " + json.dumps(record), flush=True)

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.close_bar()
        if self.file:
            self.file.close()
            self.file = None


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _number(value) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def rerun_line(record: dict) -> str:
    """The console line of a step that ``--rerun-mode validate_results`` re-ran."""
    outcome = ("reproducible: a problem of the data or the model" if record["rerun"] ==
               "reproducible" else "transient: not repeated on the same data, a hardware fault; "
               "continuing with the re-run's result")
    return (f"rerun at iteration {record['iteration']}: {record['rerun_reason']}; the step was "
            f"re-run on the same data: {outcome}")


class Throughput:
    """Tokens per second of the whole job since training started (wall clock)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> float:
        self.tokens += tokens
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)
