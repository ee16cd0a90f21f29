"""Listing and loading agree right after a plugin is re-installed.

stevedore's entry-point cache is keyed by directory mtimes packed into 32-bit floats (about two
minutes of resolution), so a plugin re-installed within that window with a new entry point used
to be listed (importlib.metadata) but not loadable (stevedore). This installs a real editable
distribution with pip, twice within seconds, and asks both in this process and in fresh ones,
as ``plugtron plugins list`` and then ``plugtron train`` would.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
from plugtron.core.plugins import registry

# It pip-installs into the venv every other test reads its plugins from: run it alone.
pytestmark = pytest.mark.serial

DISTRIBUTION = "plugtron-reinstall-probe"
PACKAGE = "plugtron_reinstall_probe"
GROUP = "plugtron.optimizers"

MODULE = """
from plugtron.core.contracts.hookspecs import hookimpl


class {cls}:
    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        raise NotImplementedError("a probe, never run")
"""

# What a fresh process sees: the names listed, and for each what loading gives.
PROBE = """
import json
from plugtron.core.plugins import registry
from plugtron.core.errors import PluginError

names = [i.name for i in registry.available("optimizer") if i.name.startswith("probe-")]
loaded = {}
for name in names:
    try:
        loaded[name] = registry.load("optimizer", name).__name__
    except PluginError as exc:
        loaded[name] = "ERROR " + str(exc)
print(json.dumps({"listed": names, "loaded": loaded}))
"""


def write_project(root, entry_points: dict[str, tuple[str, str]]) -> None:
    """A setuptools project whose entry points name ``module:Class`` pairs of its package."""
    package = root / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    lines = []
    for name, (module, cls) in entry_points.items():
        (package / f"{module}.py").write_text(MODULE.format(cls=cls))
        lines.append(f'"{name}" = "{PACKAGE}.{module}:{cls}"')
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{DISTRIBUTION}"
        version = "0.1"

        [tool.setuptools]
        packages = ["{PACKAGE}"]

        [project.entry-points."{GROUP}"]
        """) + "\n".join(lines) + "\n")


def pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check",
                             "--no-input", *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def install(root) -> None:
    pip("install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(root))


def fresh_process(cache_home) -> dict:
    # A private, persistent XDG cache: what stevedore wrote in the first process is still
    # there for the second, as it would be for a user, without touching the user's cache.
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def in_this_process() -> dict:
    importlib.invalidate_caches()  # the new module file must be importable at once
    names = [i.name for i in registry.available("optimizer") if i.name.startswith("probe-")]
    return {"listed": names,
            "loaded": {name: registry.load("optimizer", name).__name__ for name in names}}


@pytest.fixture()
def project(tmp_path, monkeypatch):
    root = tmp_path / "project"
    # The editable install's path entry (.pth) is read at interpreter start only; this process
    # needs it on sys.path by hand, fresh processes find it themselves.
    monkeypatch.syspath_prepend(str(root))
    yield root
    pip("uninstall", "-y", "-q", DISTRIBUTION)
    for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        del sys.modules[name]


def test_a_reinstalled_plugin_is_listed_and_loaded_at_once(project, tmp_path):
    cache_home = tmp_path / "cache"
    write_project(project, {"probe-one": ("one", "ProbeOne")})
    install(project)
    first = {"listed": ["probe-one"], "loaded": {"probe-one": "ProbeOne"}}
    assert in_this_process() == first
    assert fresh_process(cache_home) == first

    write_project(project, {"probe-one": ("one", "ProbeOne"), "probe-two": ("two", "ProbeTwo")})
    install(project)  # seconds later: well inside stevedore's cache resolution
    second = {"listed": ["probe-one", "probe-two"],
              "loaded": {"probe-one": "ProbeOne", "probe-two": "ProbeTwo"}}
    assert in_this_process() == second
    assert fresh_process(cache_home) == second
