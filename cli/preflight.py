"""Checks made before any rank starts: paths the run will write, finite numbers, and whether
the run's memory estimate fits one rank's memory (``--no-memory-check`` skips that)."""

from __future__ import annotations

import math
import os

import click
from plugtron.core.errors import ConfigError


def check_finite(config) -> None:
    """A NaN or infinite float (``--lr nan``) would only fail deep inside torch."""
    for name, section in config.sections().items():
        for key, value in vars(section).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"--{key.replace('_', '-')} {value}: must be a finite number")


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_dir(path: str | None, flag: str) -> None:
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a file, not a directory")
    base = _existing_ancestor(path)
    if not os.path.isdir(base):
        raise ConfigError(f"{flag} {path!r}: {base!r} is a file, so the directory cannot be "
                          f"created")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: {base!r} is not writable")


def check_writable_file(path: str | None, flag: str) -> None:
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path!r} is not writable")
        return
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag)


def check_memory(config, world_size: int, ranks_on_node: int) -> None:
    """Refuse a run whose largest rank cannot fit (core/tools/estimate.py; ``plugtron
    estimate`` prints the table). A model that cannot be estimated (a meta build it does not
    support, a vocabulary only its data knows) is launched unchecked, with a warning."""
    from plugtron.core.tools.estimate import check_fits, estimate_memory

    try:
        estimate = estimate_memory(config, world_size)
    except ConfigError as exc:
        click.echo(f"plugtron: no memory check ({exc})", err=True)
        return
    except Exception as exc:  # noqa: BLE001 - a plugin's meta build failing must not stop a run
        click.echo(f"plugtron: no memory check (the estimate failed: {type(exc).__name__}: "
                   f"{exc})", err=True)
        return
    check_fits(estimate, ranks_on_node)


def preflight(config, world_size: int, memory_check: bool = True,
              ranks_on_node: int | None = None) -> None:
    check_finite(config)
    check_writable_dir(config.checkpoint.save, "--save")
    check_writable_file(config.logging.metrics_file, "--metrics-file")
    if memory_check:
        check_memory(config, world_size, ranks_on_node or world_size)
