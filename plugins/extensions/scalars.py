"""What the metric-logger extensions share: which numbers of a metrics record they log, and the
checks on their output directories.

The TensorBoard and W&B extensions log exactly what the metrics file holds, under the same keys,
so a curve in either tool has the name of its column in ``--metrics-file``.
"""

from __future__ import annotations

import importlib.util
import math
import os

from plugtron.api import ConfigError

#: Record keys that are not curves: the x axis and the record's kind.
NOT_SCALARS = ("iteration", "summary", "run_id")


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers (bools as 0/1), keyed as in the metrics file."""
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS or value is None or isinstance(value, (str, list, dict)):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


def require_package(module: str, extra: str, flag: str) -> None:
    """A flag whose optional dependency is missing is a clear error before launch."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{flag} needs the {module!r} package, which is not installed; "
                          f"install it with: pip install 'plugtron[{extra}]'")


def check_output_dir(path: str, flag: str) -> None:
    """``path`` is, or can be made, a writable directory (refused before any rank starts)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{flag} {path!r}: {probe!r} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: {probe!r} is not writable")
