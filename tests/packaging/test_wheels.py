"""The distributions as users get them from an index: an sdist of each, a wheel built from that
sdist, installed non-editable into a fresh venv, and run from a folder outside the tree.

Every other test imports the editable install; a wheel that left out a subpackage (plugtron-gpt's
held only ``__init__.py``) passed them all. Here the installed packages are the only plugtron on
the path: ``plugins list --check``, the default GPT, a MoE run, a Hybrid run, ``import-hf`` of a
Mixtral, a generated plugin package built and installed the same way, and a plugin whose
distribution's requirements are missing reported as not ok with the reason.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {"plugtron": ROOT, "plugtron-gpt": ROOT / "gpt_plugin",
                 "plugtron-moe": ROOT / "moe_plugin"}
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--eval-iters", "1", "--no-progress"]


def _run(argv, cwd, env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {result.returncode}:\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def _build_sdist(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    before = set(source.glob("*.egg-info"))
    try:
        name = _run([sys.executable, "-c", code, str(out)],
                    cwd=source).stdout.strip().splitlines()[-1]
    finally:
        # setuptools leaves NAME.egg-info in the tree; at the repository root it would stand
        # for the installed plugtron's metadata (entry points too) in every later process
        # started there, and go stale with the next setup.cfg change.
        for made in set(source.glob("*.egg-info")) - before:
            shutil.rmtree(made, ignore_errors=True)
    return out / name


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel paths, venv environment, a working folder outside the tree)."""
    root = tmp_path_factory.mktemp("wheels")
    sdists = [_build_sdist(src, root / "sdist") for src in DISTRIBUTIONS.values()]
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(root / "dist"), *map(str, sdists)], cwd=root)
    wheels = sorted((root / "dist").glob("*.whl"))
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=root)
    python = str(venv / "bin" / "python")
    site = pathlib.Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], cwd=root).stdout.strip())
    _link_installed("torch", site)
    _run([python, "-m", "pip", "install", "-q", *map(str, wheels)], cwd=root)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTHON", "PLUGTRON_", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = root / "work"
    work.mkdir()
    return wheels, env, work


def _requirement_names(dist: importlib.metadata.Distribution) -> list[str]:
    return [re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0] for req in dist.requires or ()
            if "extra ==" not in req]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _link_installed(name: str, site: pathlib.Path) -> None:
    """``name`` and what it requires, as this environment has them installed, hard-linked into
    ``site`` (copied where links cannot be made), as if pip had installed them there: torch is
    what users have before they install plugtron, and unpacking its wheel again took 25-50 s
    of this test. Distributions ``site`` already holds (pip, setuptools) are left alone."""
    present = {_normal(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    todo, seen = [name], set()
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = _normal(dist.metadata["Name"])
        if key in seen or key in present:
            continue
        seen.add(key)
        todo += _requirement_names(dist)
        base = pathlib.Path(str(dist.locate_file("")))
        for relative in dist.files or ():
            if ".." in relative.parts or relative.suffix == ".pyc":
                continue  # console scripts (bin/) name this venv's python; bytecode is rebuilt
            source, target = base / relative, site / relative
            if not source.is_file():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)


def _packages_of(setup_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """{import name: source folder} of every package a distribution ships, from its setup.cfg
    (``package_dir`` mappings, or the folders under the setup.cfg)."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_dir / "setup.cfg")
    mapping = {}
    for line in cfg.get("options", "package_dir", fallback="").strip().splitlines():
        name, _, folder = line.partition("=")
        mapping[name.strip()] = setup_dir / folder.strip()
    if mapping:
        return mapping
    return {p.name: p for p in setup_dir.iterdir() if (p / "__init__.py").exists()
            and p.name != "tests" and p != setup_dir}


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_each_wheel_holds_every_module_of_its_tree(installed, distribution):
    wheels, _, _ = installed
    prefix = distribution.replace("-", "_") + "-"
    wheel = next(w for w in wheels if w.name.startswith(prefix))
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = _packages_of(DISTRIBUTIONS[distribution])
    missing = []
    for folder in set(packages.values()):
        for module in folder.rglob("*.py"):
            if {"tests", "__pycache__"} & set(module.relative_to(folder).parts):
                continue
            # the innermost mapping owns it (core/api/ is plugtron.api, not plugtron.core.api)
            package, root = max(((name, path) for name, path in packages.items()
                                 if module.is_relative_to(path)), key=lambda np: len(np[1].parts))
            inside = "/".join([*package.split("."), *module.relative_to(root).parts])
            if inside not in names:
                missing.append(inside)
    assert not missing, f"{wheel.name} lacks {sorted(set(missing))[:10]}"


def test_every_installed_plugin_checks_out(installed):
    _, env, work = installed
    result = _run(["plugtron", "plugins", "list", "--check"], cwd=work, env=env)
    assert "FAILED" not in result.stdout
    for name in ("gpt", "hybrid", "mixtral", "allgather", "moe", "distributed-adam"):
        assert f"    {name} " in result.stdout


def test_the_default_gpt_trains(installed):
    _, env, work = installed
    result = _run(["plugtron", "train", *TINY], cwd=work, env=env)
    assert '"iterations": 2' in result.stdout


def test_a_moe_run_on_two_ranks(installed):
    _, env, work = installed
    result = _run(["plugtron", "train", *TINY, "--num-experts", "4", "--moe-router-topk", "2",
                   "--nproc-per-node", "2", "--expert-model-parallel-size", "2"],
                  cwd=work, env=env)
    assert '"iterations": 2' in result.stdout


def test_a_hybrid_run(installed):
    _, env, work = installed
    result = _run(["plugtron", "train", *TINY, "--model", "hybrid",
                   "--hybrid-layer-pattern", "M*"], cwd=work, env=env)
    assert '"iterations": 2' in result.stdout


def test_import_hf_of_a_mixtral(installed, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    _, env, work = installed
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = _run(["plugtron", "convert", "import-hf", str(tmp_path / "hf"),
                   str(tmp_path / "ckpt")], cwd=work, env=env)
    assert (tmp_path / "ckpt" / "metadata.json").exists(), result.stdout
    assert "--num-experts 4" in result.stdout


def test_a_generated_plugin_package_installs_from_its_wheel_and_passes_its_tests(installed):
    _, env, work = installed
    package = work / "plugtron-shiny"
    _run(["plugtron", "plugin", "new", "model", "shiny", str(package)], cwd=work, env=env)
    _run(["python", "-m", "pip", "install", "-q", "pytest", f"{package}[test]"],
         cwd=work, env=env)
    # the tests run against the installed package, not the folder beside them
    result = _run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   str(package / "tests")], cwd=work, env={**env, "OMP_NUM_THREADS": "1"})
    assert " passed" in result.stdout


def test_a_plugin_whose_requirements_are_missing_is_reported_not_ok(installed):
    """Last in this module: it uninstalls plugtron-gpt from the throw-away venv."""
    _, env, work = installed
    _run(["python", "-m", "pip", "uninstall", "-q", "-y", "plugtron-gpt"], cwd=work, env=env)
    result = _run(["plugtron", "plugins", "list", "--check"], cwd=work, env=env, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("    mixtral "))
    assert "FAILED" in line
    assert "needs plugtron-gpt" in result.stdout
    result = _run(["plugtron", "train", *TINY, "--num-experts", "4"], cwd=work, env=env,
                  check=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
