"""The public plugin API: the built-in plugins reach the core through ``plugtron.api`` only, and
docs/api.md documents exactly the names it exports."""

from __future__ import annotations

import ast
import pathlib
import re

import plugtron.api as api
import pytest

ROOT = pathlib.Path(__file__).parents[2]
#: Folders of plugin code that must use the public API only.
PLUGIN_DIRS = [ROOT / "plugins", ROOT / "gpt_plugin", ROOT / "moe_plugin"]
ALLOWED = ("plugtron.api",)
#: A plugin's own conformance kit (its ``testing`` module, e.g. plugtron_moe.testing) is test
#: support that third parties import from their tests: it builds on the public kit as well.
KIT_ALLOWED = ALLOWED + ("plugtron.testing",)


def allowed_for(path: pathlib.Path) -> tuple[str, ...]:
    return KIT_ALLOWED if path.stem == "testing" or "testing" in path.parent.parts else ALLOWED


def plugin_files() -> list[pathlib.Path]:
    return sorted(p for folder in PLUGIN_DIRS if folder.exists() for p in folder.rglob("*.py")
                  if ".venv" not in p.parts and "tests" not in p.parts)


def plugtron_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "plugtron" or n.startswith("plugtron.")]
    return out


def test_there_is_plugin_code_to_check():
    assert len(plugin_files()) > 10


@pytest.mark.parametrize("path", plugin_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_builtin_plugins_import_the_core_only_through_plugtron_api(path):
    bad = [f"line {line}: {name}" for line, name in plugtron_imports(path)
           if not name.startswith(allowed_for(path))]
    assert not bad, (f"{path.relative_to(ROOT)} imports plugtron outside the public API "
                     f"(add the name to core/api/__init__.py and docs/api.md instead): {bad}")


def test_the_check_catches_an_internal_import(tmp_path):
    sample = tmp_path / "p.py"
    sample.write_text("from plugtron.core.training.optimizer import TorchOptimizer\n"
                      "import plugtron.core.parallel.comm as comm\nfrom plugtron.api import hookimpl\n")
    names = [n for _, n in plugtron_imports(sample) if not n.startswith(ALLOWED)]
    assert names == ["plugtron.core.training.optimizer", "plugtron.core.parallel.comm"]


def test_every_exported_name_exists_and_is_documented():
    doc = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", doc, flags=re.M))
    for name in api.__all__:
        assert hasattr(api, name), name
    assert documented == set(api.__all__), (
        f"docs/api.md and plugtron.api.__all__ differ: only documented "
        f"{sorted(documented - set(api.__all__))}, only exported "
        f"{sorted(set(api.__all__) - documented)}")
