"""docs/config.md lists every setting: the core's sections and the built-in plugins' (field,
flag, default, help), generated from the dataclasses. Regenerate it with
``python -m tests.docs.test_config_doc`` after changing a field."""

from __future__ import annotations

import pathlib

from plugtron.core.config import SECTIONS
from plugtron.core.config_flags import section_flag_fields
from plugtron.core.plugins.options import collect_sections

from tests.utils import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"

HEAD = """# Settings

Every setting of `plugtron train`, by section: the field (`config.<section>.<field>` inside a
run, and its key in config files), its flag, default and meaning. The core's sections come
first; the built-in plugins' follow (a plugin's options exist when it is installed; a section
that *extends* `model` reads as `config.model.<field>`). Generated from the dataclasses by
`python -m tests.docs.test_config_doc`; tests/docs/test_config_doc.py keeps it current.
"""


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(fields) -> list[str]:
    rows = ["| field | flag | default | meaning |", "|---|---|---|---|"]
    for f in fields:
        flag = f.flag + (f" / {f.negative}" if f.negative else "")
        flag += "".join(f", {a}" for a in f.aliases)
        rows.append(f"| `{f.name}` | `{_cell(flag)}` | `{_cell(f.default)}` | {_cell(f.help)} |")
    return rows


def render() -> str:
    lines = [HEAD]
    for name, cls in SECTIONS.items():
        lines += [f"## `{name}` (core)", "", *_table(section_flag_fields(name, cls)), ""]
    declared_by_name = {}
    # drivers' sections exist when they are selected: every built-in driver once
    selections = [{"model": model, "data": data} for model in ("gpt", "hybrid")
                  for data in ("mock", "text", "indexed")]
    selections += [{"optimizer": "sgd"}, {"optimizer": "distributed-adam"}, {"optimizer": "muon"},
                   {"data-parallel": "fsdp2"}]
    for flags in selections:
        for declared in collect_sections(tiny_config(**flags)):
            declared_by_name.setdefault(declared.section.name, declared)
    for _, declared in sorted(declared_by_name.items()):
        section = declared.section
        extends = f", extends `{section.extends}`" if section.extends else ""
        lines += [f"## `{section.name}` ({declared.plugin.origin.split()[0]}{extends})", "",
                  *_table(section_flag_fields(section.name, section.cls)), ""]
    return "\n".join(lines)


def test_the_settings_page_is_current():
    assert DOC.read_text() == render(), "docs/config.md is stale: python -m tests.docs.test_config_doc"


if __name__ == "__main__":
    DOC.write_text(render())
