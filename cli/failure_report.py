"""After a failed multi-rank job: one report naming the root cause, not every survivor's
traceback.

A rank killed by a signal (or that exited without an error of its own) is the cause; ranks
that then failed waiting for it are consequences. A collective that hit
``--distributed-timeout-minutes`` is reported with the ranks that timed out waiting, the
operation they were in, and the ranks that never arrived.
"""

from __future__ import annotations

import re
import signal

from plugtron.core.monitoring import run_status

_OUR_FRAME = re.compile(r'File "[^"]*/(core|plugins|cli|plugtron_gpt)/([^"]+)", line (\d+), in (\w+)')


def how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _operation(error: str) -> str:
    """Where in plugtron a rank was waiting: its innermost plugtron frame."""
    frames = _OUR_FRAME.findall(error)
    if not frames:
        return "a collective"
    kind, path, line, func = frames[-1]
    return f"{func} ({kind}/{path}:{line})"


def _is_timeout(error: str) -> bool:
    return bool(re.search(r"[Tt]imed out|[Tt]imeout", error))


def report(status_dir: str, nproc: int, exitcodes: dict[int, int]) -> str:
    """The message for a failed job; ``exitcodes``: rank -> exit code (negative: signal)."""
    phases = {r: run_status.read(status_dir, r, "phase") or "starting" for r in range(nproc)}
    errors = {r: run_status.read(status_dir, r, "error") or "" for r in range(nproc)}
    timed_out = [r for r in range(nproc) if errors[r] and _is_timeout(errors[r])]
    killed = [r for r in range(nproc) if not errors[r] and exitcodes.get(r, 0) != 0]
    lines = []
    if timed_out and not any(exitcodes.get(r, 0) < 0 and r not in killed for r in timed_out):
        late = [r for r in range(nproc) if r not in timed_out]
        first = timed_out[0]
        lines.append(f"--distributed-timeout-minutes expired: rank(s) "
                     f"{', '.join(map(str, timed_out))} waited in {_operation(errors[first])} "
                     f"during '{phases[first]}'; rank(s) {', '.join(map(str, late)) or 'none'} "
                     f"did not arrive")
        for r in late:
            lines.append(f"  rank {r}: last phase '{phases[r]}', {how_it_ended(exitcodes.get(r))} "
                         f"(stopped or hung; the launcher ended it)")
        return "\n".join(lines)
    if killed:
        for r in killed:
            lines.append(f"rank {r} {how_it_ended(exitcodes.get(r))} during '{phases[r]}'")
        others = [r for r in range(nproc) if r not in killed and errors[r]]
        if others:
            lines.append(f"rank(s) {', '.join(map(str, others))} then failed waiting for it "
                         f"({errors[others[0]].strip().splitlines()[-1][:200]})")
        return "\n".join(lines)
    failed = [r for r in range(nproc) if errors[r]]
    if failed:  # a genuine error: the first rank's full traceback, once
        r = failed[0]
        return f"rank {r} failed during '{phases[r]}':\n{errors[r].rstrip()}"
    return "a rank failed: " + ", ".join(f"rank {r} {how_it_ended(c)}" for r, c in exitcodes.items())
