"""Starting ranks: in this process, or N local ranks through torch.distributed.run."""

from __future__ import annotations

import os
import sys
import tempfile

from plugtron.core.errors import PlugtronError

ERROR_FILE_ENV = "PLUGTRON_ERROR_FILE"


def launch_local_ranks(config_json: str, nproc: int, command: str = "train") -> None:
    """Run ``plugtron.cli.rank COMMAND`` (train or evaluate) on ``nproc`` local ranks; a user
    error raised in a rank comes back as ``PlugtronError`` with the rank's message."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The ranks print their own errors; the launcher's failure report would repeat them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # Share the cores between the local ranks (and keep torchrun from warning about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))

    with tempfile.TemporaryDirectory(prefix="plugtron-launch-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            f.write(config_json)
        error_file = os.path.join(tmp, "user_error.txt")
        os.environ[ERROR_FILE_ENV] = error_file
        args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
                           "-m", "plugtron.cli.rank", command, config_path])
        try:
            run(args)
        except ChildFailedError:
            if os.path.exists(error_file):
                with open(error_file) as f:
                    raise PlugtronError(f.read().strip()) from None
            raise PlugtronError("a rank failed; its error is printed above") from None
        finally:
            os.environ.pop(ERROR_FILE_ENV, None)


def report_user_error(message: str) -> None:
    """Called in a rank: leave the message for the launcher (first writer wins)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path and not os.path.exists(path):
        try:
            with open(path, "x") as f:
                f.write(message)
        except FileExistsError:
            pass
    if not path:  # under torchrun: nobody else prints it; under plugtron's launcher, it does
        print(f"Error: {message}", file=sys.stderr, flush=True)
