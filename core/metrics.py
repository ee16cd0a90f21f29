"""What a run tells its user: a progress bar and console lines on rank 0, and a JSON-lines
metrics file (one object per training iteration, per evaluation, and a final summary)."""

from __future__ import annotations

import json
import sys
import time


class MetricsLogger:
    def __init__(self, config, rank: int, start_iteration: int = 0):
        self.config = config
        self.enabled = rank == 0
        self.file = None
        self.bar = None
        if not self.enabled:
            return
        path = config.logging.metrics_file
        if path:
            self.file = open(path, "a", buffering=1)
        if config.logging.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=config.training.train_iters, initial=start_iteration,
                            unit="it", dynamic_ncols=True, file=sys.stderr)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")

    def train_step(self, record: dict) -> None:
        if not self.enabled:
            return
        self.write(record)
        it = record["iteration"]
        if self.bar is not None:
            self.bar.update(it - self.bar.n)
            self.bar.set_postfix(loss=f"{record['lm_loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_sec']:.0f}", refresh=False)
        interval = self.config.training.log_interval
        if self.bar is None and interval and (it % interval == 0 or it == 1):
            print(f"iteration {it:6d}/{self.config.training.train_iters} | "
                  f"lm loss {record['lm_loss']:.4f} | grad norm {record['grad_norm']:.3f} | "
                  f"lr {record['lr']:.3e} | {record['tokens_per_sec']:.0f} tokens/s | "
                  f"{record['step_time_s'] * 1000:.0f} ms/step", flush=True)

    def evaluation(self, record: dict) -> None:
        if not self.enabled:
            return
        self.write(record)
        self._print(f"validation at iteration {record['iteration']} | "
                    f"valid lm loss {record['valid_lm_loss']:.4f}")

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


class Throughput:
    """Tokens per second of the whole job since training started (wall clock)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> float:
        self.tokens += tokens
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)
