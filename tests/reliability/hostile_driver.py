"""Runs `plugtron` commands in one process on hostile inputs and reports, per case, the exit
code, whether a traceback escaped, and every forbidden file it opened (the targets outside the
checkpoint that the hostile manifests name).

``python -m tests.reliability.hostile_driver CASES_JSON REPORT_JSON``; CASES_JSON holds
``{"forbidden": [paths], "cases": [{"name", "args"}]}``. Memory is capped (RLIMIT_DATA) so that an
allocation sized by a hostile field fails loudly instead of swapping; opens are seen through
Python's audit hooks (``open`` events: builtins, os.open, io).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import time
import traceback

MEMORY_CAP = 6 << 30


def main(cases_path: str, report_path: str) -> None:
    with open(cases_path) as f:
        spec = json.load(f)
    forbidden = [os.path.realpath(d) for d in spec["forbidden"]]
    opened: list[str] = []

    def audit(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            opened.append(os.fsdecode(args[0]))

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_CAP, hard))
    from plugtron.cli.main import cli  # imports torch once for every case

    sys.addaudithook(audit)
    results = []
    for case in spec["cases"]:
        opened.clear()
        out = io.StringIO()
        start = time.monotonic()
        rc, tb = 0, None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                cli.main(case["args"], prog_name="plugtron", standalone_mode=True)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - what the test looks for
                rc, tb = 1, traceback.format_exc()
        outside = sorted({p for p in opened if _forbidden(p, forbidden)})
        results.append({"name": case["name"], "rc": rc, "traceback": tb,
                        "output": _ends(out.getvalue()), "outside": outside,
                        "seconds": time.monotonic() - start})
    results.append({"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    with open(report_path, "w") as f:
        json.dump(results, f)


def _ends(text: str, keep: int = 2000) -> str:
    """The start and the end of a command's output: a header (inspect's iteration line) and
    the last message both matter, a long listing between them does not."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}\n...\n{text[-keep:]}"


def _forbidden(path: str, forbidden: list[str]) -> bool:
    for candidate in {os.path.abspath(path), os.path.realpath(path)}:
        if any(candidate == d or candidate.startswith(d + os.sep) for d in forbidden):
            return True
    return False


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
