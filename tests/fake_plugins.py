"""Installs fake distributions with entry points for registry tests (no pip involved)."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import sys
import textwrap


def install_fake_distribution(root: pathlib.Path, name: str, version: str,
                              entry_points: dict[str, dict[str, str]],
                              modules: dict[str, str]) -> None:
    """Write ``<name>-<version>.dist-info`` plus module files under ``root`` (on sys.path)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{ep} = {target}" for ep, target in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    importlib.invalidate_caches()  # the import system must see the files written just now


def remove_path(root: pathlib.Path) -> None:
    if str(root) in sys.path:
        sys.path.remove(str(root))
    importlib.invalidate_caches()


@contextlib.contextmanager
def fake_distribution(root: pathlib.Path, name: str, group: str, entry: str, module: str,
                      source: str, version: str = "0.1.0"):
    """One plugin in a fake distribution on ``sys.path`` for the ``with`` block: entry point
    ``entry`` of ``group`` naming ``module:<Class>`` (``entry`` maps to its target)."""
    install_fake_distribution(root, name, version, {group: {entry.split("=")[0]:
                                                            entry.split("=")[1]}},
                              {module: source})
    try:
        yield
    finally:
        remove_path(root)
