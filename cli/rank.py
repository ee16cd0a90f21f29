"""Entry of one launched rank: ``python -m plugtron.cli.rank {train|evaluate|generate} CONFIG_JSON``."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import NoReturn

import torch
from plugtron.core.contracts.versions import show_deprecations
from plugtron.core.errors import PlugtronError
from plugtron.core.monitoring import run_status
from plugtron.core.parallel.distributed import init_distributed, timeout_seconds
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


def main(argv: list[str]) -> NoReturn:
    """Run the command, then leave at once with its exit code (see :func:`leave`)."""
    leave(_run(argv))


def leave(code: int) -> NoReturn:
    """End this rank without the interpreter's teardown.

    Everything the run owed is done by now (the final checkpoint committed, metrics and logs
    closed); what is left is torch's and gloo's C++ state and the interpreter's threads. Tearing
    those down raced with the peers' own exits: a thread destroyed while joinable, or a daemon
    thread unwound out of torch at finalisation, aborted a finished rank intermittently
    ("terminate called without an active exception", killed by SIGABRT during 'done'; 2 fresh
    CI runs in 2 on a loaded 2-core machine). ``os._exit`` runs no destructor, so a finished
    rank's exit cannot race; the kernel closes its sockets after the data already sent."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run(argv: list[str]) -> int:
    tie_to_parent()
    show_deprecations()
    preemption.install()
    run_status.set_phase("setup")
    command, path = argv
    under_launcher = bool(os.environ.get(run_status.STATUS_DIR_ENV))
    try:
        from plugtron.core.config_freeze import freeze
        from plugtron.core.plugins.options import config_from_dict

        with open(path) as f:
            config = freeze(config_from_dict(json.load(f)))  # validated by the launcher
        if config.training.exit_signal_handler:
            preemption.install(extra=True)
        init_distributed(timeout_seconds(config))
        COMMANDS[command](config)
    except PlugtronError as exc:
        # No goodbye barrier: other ranks may be stuck waiting for this one; the launcher
        # stops them.
        report_user_error(str(exc))
        return 2
    except Exception:  # noqa: BLE001 - reported once, by the launcher, with the root cause
        run_status.write_error(traceback.format_exc())
        if not under_launcher:
            traceback.print_exc()
        return 1
    if preemption.stopped is not None:
        message, code = preemption.final_message(config), preemption.stopped[1]
        run_status.set_phase(f"stopped {code} {message}")
        if int(os.environ.get("RANK", 0)) == 0 and not under_launcher:
            print(message, flush=True)
        _wait_for_peers()
        return 0 if under_launcher else code  # plugtron's launcher reports it and exits so
    run_status.set_phase("done")
    _wait_for_peers()
    return 0


def _wait_for_peers() -> None:
    """Leave together: no rank closes its connections while a peer may still be receiving
    from it. The process group is not destroyed; :func:`leave` ends the process instead."""
    if torch.distributed.is_initialized():
        try:
            torch.distributed.barrier()
        except Exception:  # noqa: BLE001 - this rank's work is done; a peer that died after
            pass  # its own is the launcher's to judge (every rank's phase says 'done')


if __name__ == "__main__":
    main(sys.argv[1:])
