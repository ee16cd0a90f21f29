"""benchmarks/RESULTS.md holds the latest figures of each benchmark: a script's section replaces
the one it wrote before (same heading, dates aside) instead of piling up after it; earlier runs
stay in git history."""

from __future__ import annotations

import pathlib
import re

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")
_DATED = re.compile(r"\s*(\(\d{4}-\d\d-\d\d[^)]*\)|— \d{4}-\d\d-\d\d.*)\s*$")


def _title(heading: str) -> str:
    """A section's heading without its date: what identifies the benchmark's section."""
    return _DATED.sub("", heading.removeprefix("## ").strip())


def write_section(text: str, path: pathlib.Path = RESULTS) -> None:
    """Put ``text`` (markdown starting with a ``## `` heading) in ``path``: in place of the
    section with the same heading (dates aside), else at the end."""
    text = text.strip("\n") + "\n"
    heading = next(line for line in text.splitlines() if line.startswith("## "))
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    parts = re.split(r"(?m)^(?=## )", old)
    for i, part in enumerate(parts):
        if part.startswith("## ") and _title(part.splitlines()[0]) == _title(heading):
            parts[i] = text + ("\n" if i < len(parts) - 1 else "")
            break
    else:
        parts.append(("\n" if not parts[-1].endswith("\n\n") else "") + text)
    path.write_text("".join(parts))
