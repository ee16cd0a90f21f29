"""``python -m tests.reliability.pretrain_driver SAVE ITERS METRICS``: a run started from Python
(``pretrain()``, no CLI) saving into SAVE; exit 2 with the message on a CheckpointError."""

from __future__ import annotations

import sys

from plugtron.core.errors import CheckpointError
from plugtron.core.training.loop import pretrain

from tests.utils import tiny_config


def main(save: str, iters: str, metrics: str) -> int:
    config = tiny_config(train_iters=int(iters), lr_warmup_iters=1, save=save,
                         metrics_file=metrics)
    try:
        pretrain(config)
    except CheckpointError as exc:
        print(f"CheckpointError: {exc}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
