"""Entry of one launched rank: ``python -m plugtron.cli.rank {train|evaluate} CONFIG_JSON``."""

from __future__ import annotations

import json
import sys

from plugtron.core.distributed import shutdown
from plugtron.core.errors import PlugtronError

from .launch import report_user_error


def _train(config):
    from plugtron.core.training import pretrain

    pretrain(config)


def _evaluate(config):
    from plugtron.core.checkpoint.evaluate import evaluate_checkpoint

    evaluate_checkpoint(config)


COMMANDS = {"train": _train, "evaluate": _evaluate}


def main(argv: list[str]) -> int:
    command, path = argv
    try:
        from plugtron.core.plugin_options import config_from_dict

        with open(path) as f:
            config = config_from_dict(json.load(f))
        COMMANDS[command](config)
    except PlugtronError as exc:
        # No goodbye barrier: other ranks may be stuck waiting for this one; the launcher
        # stops them.
        report_user_error(str(exc))
        shutdown()
        return 2
    # Leave the process group together before exit: gloo torn down at interpreter exit while
    # a peer is still connected intermittently aborts ("terminate called without an active
    # exception"); destroying the group without the barrier first still did, 2 runs in 12.
    shutdown(barrier=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
