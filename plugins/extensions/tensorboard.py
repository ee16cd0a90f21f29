"""Extension ``tensorboard``: every metric of the run as TensorBoard scalars (Megatron's
``--tensorboard-dir``).

Rank 0 writes one event file per run under ``--tensorboard-dir``: each training step's numbers
(every loss the model reports, aux losses, ``grad_norm``, ``lr``, ``loss_scale``,
``tokens_per_sec``, ``step_time_s``, ``memory_mb`` ...) and each evaluation's ``valid_*`` losses,
tagged with their metrics-file keys, against the iteration; the run's config as text. Needs the
``tensorboard`` package: ``pip install 'plugtron[tensorboard]'``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from plugtron.api import ConfigError, ConfigSection, hookimpl, opt

from .scalars import check_output_dir, require_package, scalars


@dataclass
class TensorBoardOptions:
    tensorboard_dir: str | None = opt(None, "--tensorboard-dir",
                                      "Write TensorBoard event files (rank 0) into this directory.")
    tensorboard_log_interval: int = opt(1, "--tensorboard-log-interval",
                                        "Write training scalars every N iterations.")
    tensorboard_queue_size: int = opt(1000, "--tensorboard-queue-size",
                                      "Events kept in memory before the writer flushes them.")


class TensorBoardLogger:
    def __init__(self):
        self.rank = 0
        self.writer = None

    @hookimpl
    def plugtron_config_sections(self):
        return [ConfigSection("tensorboard", TensorBoardOptions, title="TensorBoard")]

    @hookimpl
    def plugtron_validate(self, config, world_size):
        options = config.tensorboard
        if options.tensorboard_dir is None:
            return
        for name in ("tensorboard_log_interval", "tensorboard_queue_size"):
            if getattr(options, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(options, name)}: must "
                                  f"be at least 1")
        require_package("tensorboard", "tensorboard", "--tensorboard-dir")
        check_output_dir(options.tensorboard_dir, "--tensorboard-dir")

    @hookimpl
    def plugtron_process_groups_ready(self, parallel):
        self.rank = parallel.rank

    @hookimpl
    def plugtron_train_start(self, config, state):
        options = config.tensorboard
        if self.rank != 0 or options.tensorboard_dir is None:
            return
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional extra plugtron[tensorboard]
        self.options = options
        self.writer = SummaryWriter(log_dir=options.tensorboard_dir,
                                    max_queue=options.tensorboard_queue_size)
        self.writer.add_text("config", "```\n" + json.dumps(config.to_dict(), indent=1,
                                                             default=str) + "\n```",
                             global_step=state.iteration)
        print(f"plugtron: TensorBoard events go to {options.tensorboard_dir}", flush=True)

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        if self.writer is not None and iteration % self.options.tensorboard_log_interval == 0:
            self._write(iteration, metrics)

    @hookimpl
    def plugtron_evaluation_end(self, iteration, metrics):
        if self.writer is not None:
            self._write(iteration, metrics)

    @hookimpl
    def plugtron_train_end(self, config, state, summary):
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None

    def _write(self, iteration, metrics):
        for tag, value in scalars(metrics).items():
            self.writer.add_scalar(tag, value, global_step=iteration)

