"""docs/architecture.md lists every entry-point group that the three distributions declare,
and every role the core's registry knows."""

from __future__ import annotations

import configparser
import pathlib
import re

from plugtron.core.plugins.registry import GROUPS

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETUP_FILES = ("setup.cfg", "gpt_plugin/setup.cfg", "moe_plugin/setup.cfg")


def declared_groups() -> set[str]:
    groups = set()
    for name in SETUP_FILES:
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(ROOT / name)
        groups |= set(parser["options.entry_points"])
    return groups


def documented_groups() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Entry-point groups", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w.]+)` \|", section, re.M))


def test_every_declared_group_is_documented_and_no_other():
    # a core role's group is documented even before a built-in plugin declares it
    assert documented_groups() == declared_groups() | set(GROUPS.values())


def test_every_registry_role_has_its_group_documented():
    assert set(GROUPS.values()) <= documented_groups()
