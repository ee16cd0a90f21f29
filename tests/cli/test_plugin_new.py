"""``plugtron plugin new``: every kind writes a package that installs, passes its own tests
exactly as generated and passes ``plugtron plugins check``; the code on docs/plugins/*.md is
the generated code; a bad NAME or an existing DIR exits 2 and writes nothing; the templates
ship in the wheel.

Each package is pip-installed with ``--target`` into its own folder (never into this venv) and
its tests run in a subprocess that sees that folder, as they would after ``pip install -e``.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.cli.plugin_new import KINDS, Names, kinds, render

from tests.doc_packages import doc_files

ROOT = pathlib.Path(__file__).parents[2]
#: kind -> the NAME generated here, and shown on that kind's docs page
NAMES = {"model": "prefix-mean", "schedule": "deep-warmup", "optimizer": "lion",
         "data_parallel": "flat-allreduce",
         "dataset": "repeat", "layer": "gated-mlp", "extension": "csv-log",
         "model_transform": "fc2-scale", "moe_dispatcher": "relay"}  # the last: plugtron-moe's declared role, its template
#: kind -> its docs page (the model's is the tutorial, with its own test and its own model)
PAGE_NAMES = {"data_parallel": "data-parallel.md", "model_transform": "transforms.md"}
PAGES = {kind: ROOT / "docs" / "plugins" / PAGE_NAMES.get(kind, f"{kind}s.md")
         for kind in KINDS if kind != "model"}
#: The names each part of a generated package may import from plugtron.
ALLOWED_IMPORTS = {"plugin": ("plugtron.api",), "tests": ("plugtron.api", "plugtron.testing")}


def invoke(args: list[str]):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def pip_install_target(package: pathlib.Path, site: pathlib.Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(package)],
                   check=True, capture_output=True)


def env_with(*paths: pathlib.Path) -> dict:
    """This environment (plugtron and plugtron-gpt installed) plus ``paths`` first."""
    pythonpath = [str(p) for p in paths] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    env.pop("PLUGTRON_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """``get(kind)`` -> (package dir, its --target site), generated and installed once."""
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            root = tmp_path_factory.mktemp(kind)
            package, site = root / f"plugtron-{NAMES[kind]}", root / "site"
            result = invoke(["plugin", "new", kind, NAMES[kind], str(package)])
            assert result.exit_code == 0, result.output
            pip_install_target(package, site)
            made[kind] = package, site
        return made[kind]

    return get


def test_a_declared_role_with_a_template_is_a_kind():
    assert kinds() == {**KINDS, "moe_dispatcher": "plugtron.moe_dispatchers"}


@pytest.mark.parametrize("kind", list(kinds()))
def test_the_generated_package_passes_its_own_tests(generated, kind):
    package, site = generated(kind)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=package, env=env_with(site, package), capture_output=True,
                          text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary


def test_every_generated_plugin_passes_plugins_check(generated):
    """Their hooks hold against the hookspecs, as `plugtron plugins check` sees them (all in
    one run: each would otherwise pay a start of its own)."""
    sites = [generated(kind)[1] for kind in kinds()]
    check = subprocess.run([sys.executable, "-m", "plugtron.cli.main", "plugins", "check",
                            *NAMES.values()], env=env_with(*sites), capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{len(NAMES)} plugin(s) checked, 0 problem(s)" in check.stdout, check.stdout
    for kind, name in NAMES.items():
        assert f"{kind} {name!r} (plugtron-{name} 0.1.0)" in check.stdout, check.stdout


def test_the_generated_model_trains_from_the_cli_and_lists_its_options(generated):
    package, site = generated("model")
    env = env_with(site)
    base = [sys.executable, "-m", "plugtron.cli.main", "train", "--model", "prefix-mean"]
    help_text = subprocess.run([*base, "--help"], env=env, capture_output=True, text=True)
    assert "prefix-mean model (plugtron-prefix-mean 0.1.0)" in help_text.stdout
    assert "--prefix-mean-expansion" in help_text.stdout
    done = subprocess.run([*base, "--hidden-size", "30", "--num-layers", "2", "--data", "mock",
                           "--vocab-size", "64", "--seq-length", "16", "--micro-batch-size", "2",
                           "--global-batch-size", "4", "--train-iters", "2", "--no-progress",
                           "--eval-interval", "0", "--prefix-mean-expansion", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    refused = subprocess.run([*base, "--prefix-mean-expansion", "0"], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "must be at least 1" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_schedule_show_plays_the_generated_schedule(generated):
    _, site = generated("schedule")
    done = subprocess.run([sys.executable, "-m", "plugtron.cli.main", "schedule", "show",
                           "--schedule", "deep-warmup", "--pp", "2", "--microbatches", "3"],
                          env=env_with(site), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # one warmup forward per rank beyond 1F1B's (whose rank 1 runs F0 B0 F1 B1 F2 B2)
    assert "rank 0: F0 F1 F2 B0 B1 B2" in done.stdout
    assert "rank 1: F0 F1 B0 F2 B1 B2" in done.stdout


# --------------------------------------------------------------------------- the generated code


def plugtron_imports(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
    return [name for name in out if name == "plugtron" or name.startswith("plugtron.")]


@pytest.mark.parametrize("kind", list(kinds()))
def test_the_generated_code_uses_only_the_public_api(kind):
    for path, text in render(kind, Names.of(kind, NAMES[kind])).items():
        if path.endswith(".py"):
            allowed = ALLOWED_IMPORTS["tests" if path.startswith("tests/") else "plugin"]
            bad = [name for name in plugtron_imports(text) if not name.startswith(allowed)]
            assert not bad, f"{kind}: {path} imports {bad}"


def test_the_generated_code_is_ruff_clean(tmp_path):
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    for kind in kinds():
        result = invoke(["plugin", "new", kind, NAMES[kind], str(tmp_path / kind)])
        assert result.exit_code == 0, result.output
    # each package is checked under its own pyproject's settings
    for kind in kinds():
        done = subprocess.run([ruff, "check", "--no-cache", "."], cwd=tmp_path / kind,
                              capture_output=True, text=True)
        assert done.returncode == 0, f"{kind}: {done.stdout}"


@pytest.mark.parametrize("kind", list(PAGES))
def test_the_docs_page_shows_the_generated_code(kind):
    """The page's files are the generated package's, which the test above installs and runs:
    so every example on the page is executed."""
    text = PAGES[kind].read_text()
    names = Names.of(kind, NAMES[kind])
    files = render(kind, names)
    shown = doc_files(text)
    assert {f"{names.module}.py", "tests/test_plugin.py", "pyproject.toml"} <= set(shown)
    for path, body in shown.items():
        assert path in files, f"{PAGES[kind].name} shows {path}, which is not generated"
        assert body == files[path], f"{PAGES[kind].name}: {path} differs from the template"
    assert f"plugtron plugin new {kind} {NAMES[kind]}" in text


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name,message", [
    ("MyModel", "is not a valid plugin name"),
    ("2fast", "is not a valid plugin name"),
    ("my--model", "is not a valid plugin name"),
    ("my model", "is not a valid plugin name"),
    ("model-", "is not a valid plugin name"),
    ("import", "is a Python keyword"),
    ("training", "config.training is the core's"),
    ("gpt", "a model named 'gpt' is already installed (plugtron-gpt"),
])
def test_a_bad_name_exits_2_and_writes_nothing(tmp_path, name, message):
    target = tmp_path / "out"
    result = invoke(["plugin", "new", "model", name, str(target)])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not target.exists()


def test_an_unknown_kind_exits_2_and_lists_the_kinds(tmp_path):
    result = invoke(["plugin", "new", "router", "mine", str(tmp_path / "out")])
    assert result.exit_code == 2 and "unknown KIND 'router'" in result.output
    assert "moe_dispatcher" in result.output and "model" in result.output
    assert not (tmp_path / "out").exists()


def test_a_dispatcher_name_that_is_installed_exits_2(tmp_path):
    result = invoke(["plugin", "new", "moe_dispatcher", "alltoall", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "a moe_dispatcher named 'alltoall' is already installed (plugtron-moe" in result.output


def test_a_name_whose_options_plugtron_has_exits_2(tmp_path):
    result = invoke(["plugin", "new", "extension", "lr", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "gives the plugin the option(s) --lr, which plugtron already has" in result.output


@pytest.mark.parametrize("args,message", [
    (["layer", "glu", "--symbol", "*"], "must be one character other than"),
    (["layer", "glu", "--symbol", "GG"], "must be one character other than"),
    (["model", "tiny", "--symbol", "G"], "--symbol is for layer plugins only"),
])
def test_a_bad_symbol_exits_2(tmp_path, args, message):
    result = invoke(["plugin", "new", *args, str(tmp_path / "out")])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "out").exists()


def test_an_existing_directory_is_never_overwritten(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    result = invoke(["plugin", "new", "model", "tiny", str(target)])
    assert result.exit_code == 2
    assert "exists and is not an empty directory; nothing written" in result.output
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert (target / "notes.txt").read_text() == "keep me"


def test_an_empty_directory_and_the_default_directory_are_used(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke(["plugin", "new", "dataset", "tiny", str(empty)]).exit_code == 0
    assert (empty / "plugtron_tiny.py").is_file()
    monkeypatch.chdir(tmp_path)
    result = invoke(["plugin", "new", "layer", "tiny-glu", "--symbol", "T"])
    assert result.exit_code == 0, result.output
    package = tmp_path / "plugtron-tiny-glu"
    assert sorted(p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()) \
        == ["README.md", "plugtron_tiny_glu.py", "pyproject.toml", "tests/test_plugin.py"]
    module = (package / "plugtron_tiny_glu.py").read_text()
    assert 'symbol = "T"' in module and "class TinyGluLayer(" in module
    assert 'tiny-glu = "plugtron_tiny_glu:TinyGluLayer"' in (package / "pyproject.toml").read_text()


# --------------------------------------------------------------------------- packaging


def test_the_templates_ship_in_the_wheel(tmp_path):
    """A non-editable install has the templates: build plugtron's wheel from a copy of the
    sources (the build writes build/ and *.egg-info next to them) and look inside."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("core", "cli", "plugins"):
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "out"), str(source)],
                   check=True, capture_output=True)
    [wheel] = (tmp_path / "out").glob("plugtron-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if "/templates/" in n}
    templates = {"plugtron/cli/" + p.relative_to(ROOT / "cli").as_posix()
                 for p in (ROOT / "cli" / "templates").rglob("*.tmpl")}
    assert templates and shipped == templates


def test_the_dispatcher_template_ships_in_plugtron_moe_wheel(tmp_path):
    source = tmp_path / "moe"
    top = str(ROOT / "moe_plugin")

    def skipped(folder, names):  # the distribution's own tests and build leftovers
        return [n for n in names if n == "__pycache__" or n.endswith(".egg-info")
                or (folder == top and n == "tests")]

    shutil.copytree(top, source, ignore=skipped)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "out"), str(source)],
                   check=True, capture_output=True)
    [wheel] = (tmp_path / "out").glob("plugtron_moe-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if "/templates/" in n}
    package = ROOT / "moe_plugin" / "plugtron_moe"
    templates = {"plugtron_moe/" + p.relative_to(package).as_posix()
                 for p in (package / "templates").rglob("*.tmpl")}
    assert templates and shipped == templates
