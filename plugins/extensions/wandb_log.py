"""Extension ``wandb``: every metric of the run to Weights & Biases (Megatron's
``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``).

Rank 0 opens one W&B run with the run's config and logs each training step's numbers and each
evaluation's ``valid_*`` losses under their metrics-file keys, with the iteration as W&B's step.
``--wandb-mode offline`` (also chosen when no W&B API key is found) writes the run under
``--wandb-save-dir`` without any network; ``wandb sync DIR`` uploads it later. Needs the
``wandb`` package: ``pip install 'plugtron[wandb]'``.
"""

from __future__ import annotations

import netrc
import os
from dataclasses import dataclass

from plugtron.api import ConfigError, ConfigSection, hookimpl, opt

from .scalars import check_output_dir, require_package, scalars

MODES = ("online", "offline", "disabled")


@dataclass
class WandbOptions:
    wandb_project: str | None = opt(None, "--wandb-project",
                                    "Log the run to this W&B project (rank 0).")
    wandb_exp_name: str = opt("", "--wandb-exp-name", "The W&B run's name.")
    wandb_save_dir: str = opt("", "--wandb-save-dir",
                              "Where W&B keeps its local files (default: ./wandb).")
    wandb_entity: str | None = opt(None, "--wandb-entity", "The W&B team or user.")
    wandb_mode: str | None = opt(None, "--wandb-mode", "online, offline or disabled (default: "
                                 "$WANDB_MODE, else online when an API key is found, else "
                                 "offline).", choices=MODES)


def resolve_mode(options: WandbOptions) -> str:
    if options.wandb_mode:
        return options.wandb_mode
    if os.environ.get("WANDB_MODE") in MODES:
        return os.environ["WANDB_MODE"]
    return "online" if _has_api_key() else "offline"


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger:
    def __init__(self):
        self.rank = 0
        self.run = None

    @hookimpl
    def plugtron_config_sections(self):
        return [ConfigSection("wandb", WandbOptions, title="Weights & Biases")]

    @hookimpl
    def plugtron_validate(self, config, world_size):
        options = config.wandb
        if not options.wandb_project:
            for flag, value in (("--wandb-exp-name", options.wandb_exp_name),
                                ("--wandb-save-dir", options.wandb_save_dir)):
                if value:
                    raise ConfigError(f"{flag} {value!r} needs --wandb-project NAME (W&B logs "
                                      f"only when a project is given)")
            return
        require_package("wandb", "wandb", "--wandb-project")
        if options.wandb_save_dir:
            check_output_dir(options.wandb_save_dir, "--wandb-save-dir")

    @hookimpl
    def plugtron_process_groups_ready(self, parallel):
        self.rank = parallel.rank

    @hookimpl
    def plugtron_train_start(self, config, state):
        options = config.wandb
        if self.rank != 0 or not options.wandb_project:
            return
        import wandb  # noqa: PLC0415 - optional extra plugtron[wandb]
        mode = resolve_mode(options)
        save_dir = options.wandb_save_dir or os.path.join(os.getcwd(), "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=options.wandb_project, name=options.wandb_exp_name or None,
                              entity=options.wandb_entity, dir=save_dir, mode=mode,
                              config=config.to_dict(),
                              settings=wandb.Settings(console="off", silent=True))
        where = f"offline under {save_dir} (upload: wandb sync)" if mode == "offline" else mode
        print(f"plugtron: W&B run {self.run.name or self.run.id}, {where}", flush=True)

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        if self.run is not None:
            self.run.log(scalars(metrics), step=iteration)

    @hookimpl
    def plugtron_evaluation_end(self, iteration, metrics):
        if self.run is not None:
            self.run.log(scalars(metrics), step=iteration)

    @hookimpl
    def plugtron_train_end(self, config, state, summary):
        if self.run is not None:
            self.run.summary.update(scalars(summary))
            self.run.finish()
            self.run = None
