"""Finding the ranks of a running `plugtron train --nproc-per-node N` from outside."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def ranks_of(launcher: int, module: bytes = b"plugtron.cli.rank") -> dict[int, int]:
    """{rank: pid} of the launcher's rank processes (their RANK variable): children whose
    command line names ``module`` (plugtron's launcher starts ``plugtron.cli.rank``; under
    torchrun itself, give ``b"plugtron.cli"``)."""
    out = {}
    for pid in children(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env and module in open(f"/proc/{pid}/cmdline", "rb").read():
            out[int(env[b"RANK"])] = pid
    return out
