"""Entry of one launched rank: ``python -m plugtron.cli.rank {train|evaluate|generate} CONFIG_JSON``."""

from __future__ import annotations

import json
import os
import sys
import traceback

from plugtron.core.errors import PlugtronError
from plugtron.core.monitoring import run_status
from plugtron.core.parallel.distributed import init_distributed, shutdown, timeout_seconds
from plugtron.core.training import preemption

from .launch import report_user_error
from .lifeline import tie_to_parent


def _train(config):
    from plugtron.core.training.loop import pretrain

    pretrain(config)


def _evaluate(config):
    from plugtron.core.tools.evaluate import evaluate_checkpoint

    from .evaluate import JSON_ENV

    evaluate_checkpoint(config, as_json=bool(os.environ.get(JSON_ENV)))


def _generate(config):
    from .generate import rank_main

    rank_main(config)


COMMANDS = {"train": _train, "evaluate": _evaluate, "generate": _generate}


def main(argv: list[str]) -> int:
    tie_to_parent()
    preemption.install()
    run_status.set_phase("setup")
    command, path = argv
    under_launcher = bool(os.environ.get(run_status.STATUS_DIR_ENV))
    try:
        from plugtron.core.plugins.options import config_from_dict

        with open(path) as f:
            config = config_from_dict(json.load(f))
        if config.training.exit_signal_handler:
            preemption.install(extra=True)
        init_distributed(timeout_seconds(config))
        COMMANDS[command](config)
    except PlugtronError as exc:
        # No goodbye barrier: other ranks may be stuck waiting for this one; the launcher
        # stops them.
        report_user_error(str(exc))
        shutdown()
        return 2
    except Exception:  # noqa: BLE001 - reported once, by the launcher, with the root cause
        run_status.write_error(traceback.format_exc())
        if not under_launcher:
            traceback.print_exc()
        sys.stderr.flush()
        # Skip interpreter teardown: gloo torn down while peers are gone can abort noisily.
        os._exit(1)
    if preemption.stopped is not None:
        message, code = preemption.final_message(config), preemption.stopped[1]
        run_status.set_phase(f"stopped {code} {message}")
        if int(os.environ.get("RANK", 0)) == 0 and not under_launcher:
            print(message, flush=True)
        shutdown(barrier=True)
        return 0 if under_launcher else code  # plugtron's launcher reports it and exits so
    run_status.set_phase("done")
    # Leave the process group together before exit: gloo torn down at interpreter exit while
    # a peer is still connected intermittently aborts ("terminate called without an active
    # exception"); destroying the group without the barrier first still did, 2 runs in 12.
    shutdown(barrier=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
