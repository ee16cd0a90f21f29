"""Every ``plugtron`` command in the README's and docs/' shell blocks parses: its subcommand
exists and each flag is one that command takes, with an allowed value (the README's
``--load ./hf-llama --data-path corpus_text_document`` had drifted from what works). Commands
are parsed, not run: the files and machines they name are the reader's. A path that must exist
and does not is the only error accepted."""

from __future__ import annotations

import pathlib
import re
import shlex

import click
import pytest
from plugtron.cli.main import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)


def commands(page: pathlib.Path) -> list[tuple[int, list[str]]]:
    """(line, argv after ``plugtron``) of each command in the page's shell blocks."""
    out = []
    text = page.read_text()
    for block in BLOCK.finditer(text):
        first_line = text[:block.start()].count("\n") + 2
        logical, start = "", None
        for number, line in enumerate(block.group(1).splitlines(), first_line):
            start = number if not logical else start
            logical += line.rstrip("\\").rstrip() + " "
            if line.rstrip().endswith("\\"):
                continue
            command, logical = logical.strip(), ""
            try:
                words = shlex.split(command, comments=True)
            except ValueError:
                continue
            if words[:1] == ["$"]:
                words = words[1:]
            if words[:1] == ["plugtron"] and "$(" not in command:
                out.append((start, [w for w in words[1:] if w != "..."]))  # "more flags"
    return out


CASES = [pytest.param(argv, id=f"{page.relative_to(ROOT)}:{line}")
         for page in PAGES for line, argv in commands(page)]


def parse(argv: list[str]) -> None:
    """What click does before it runs a command: resolve each subcommand, parse its options."""
    group, name, parent = cli, "plugtron", None
    args = list(argv)
    while True:
        ctx = group.make_context(name, list(args), parent=parent, resilient_parsing=False)
        if not isinstance(group, click.Group):
            return
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else \
            ctx.protected_args  # click 8.2 keeps them private (and warns on the public name)
        rest = [*protected, *ctx.args]
        if not rest:
            return
        name, group, args = group.resolve_command(ctx, rest)
        parent = ctx


def test_the_pages_have_commands():
    assert len(CASES) > 40


def _selects_a_plugin_not_installed(argv: list[str]) -> str | None:
    """The plugin a command selects that is not installed here (a page's own example plugin,
    which the reader has just written), or None."""
    from plugtron.core.plugins import registry

    for flag, role in (("--model", "model"), ("--schedule", "schedule"),
                       ("--optimizer", "optimizer"), ("--data-parallel", "data_parallel")):
        if flag in argv[:-1]:
            name = argv[argv.index(flag) + 1]
            if name != "auto" and name not in {i.name for i in registry.available(role)}:
                return f"{flag} {name}"
    return None


@pytest.mark.parametrize("argv", CASES)
def test_each_documented_command_parses(argv):
    missing = _selects_a_plugin_not_installed(argv)
    if missing:
        pytest.skip(f"{missing}: the page's own plugin, not installed here (its page's test "
                    f"installs and runs it)")
    if "--help" in argv or "-h" in argv:
        argv = [a for a in argv if a not in ("--help", "-h")] + ["--help"]
    try:
        parse(argv)
    except click.exceptions.Exit:
        pass  # --help
    except click.BadParameter as exc:
        if "does not exist" not in exc.format_message():
            raise AssertionError(f"plugtron {shlex.join(argv)}: {exc.format_message()}")
    except click.UsageError as exc:
        raise AssertionError(f"plugtron {shlex.join(argv)}: {exc.format_message()}") from None
