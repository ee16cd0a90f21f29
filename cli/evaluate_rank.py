"""Entry of one launched evaluation rank: ``python -m plugtron.cli.evaluate_rank CONFIG_JSON``."""

from __future__ import annotations

import json
import sys

from plugtron.core.config import TrainConfig
from plugtron.core.distributed import shutdown
from plugtron.core.errors import PlugtronError

from .launch import report_user_error


def main(argv: list[str]) -> int:
    from plugtron.core.checkpoint.evaluate import evaluate_checkpoint

    with open(argv[0]) as f:
        config = TrainConfig.from_dict(json.load(f))
    try:
        evaluate_checkpoint(config)
    except PlugtronError as exc:
        report_user_error(str(exc))
        return 2
    finally:
        shutdown()  # see plugtron.cli.rank
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
