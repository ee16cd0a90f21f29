"""The shape of the tree (docs/architecture.md): the core names no model, no layer of one and no
built-in plugin; no module imports itself back through others; no folder of core/ is crowded."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Source folder -> the package it installs as (setup.cfg's package_dir).
PACKAGES = {"core/api": "plugtron.api", "core/testing": "plugtron.testing", "core": "plugtron.core",
            "plugins": "plugtron.plugins", "cli": "plugtron.cli",
            "gpt_plugin/plugtron_gpt": "plugtron_gpt", "moe_plugin/plugtron_moe": "plugtron_moe"}
#: What only a model or a built-in plugin knows: its package, its layers, its options, its
#: checkpoint names.
# Rotary position math is not on the list: like linear and init it is a model-agnostic piece
# every attention model shares (GPT, Hybrid, a third party's GPT-J), so it lives in
# core/blocks/rotary.py and plugtron.api rather than inside one model plugin.
MODEL_WORDS = re.compile(r"plugtron_gpt|plugtron_moe|swiglu|\bmamba|moe_dispatcher|"
                         r"\bmoe_act\b|shared_experts|embed_tokens|lm_head|plugtron\.plugins",
                         re.IGNORECASE)
MAX_MODULES = 15


def modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the three distributions."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if "templates" in rel.parts or any(str(path).startswith(str(ROOT / f) + "/")
                                               for f in PACKAGES if f != folder
                                               and f.startswith(folder + "/")):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_itself_back():
    mods = modules()
    known = set(mods)
    # A package's __init__ re-exports its children: leave those edges out, as a reader would.
    graph = {name: {t for t in imports_of(name, path, known) if mods[t].name != "__init__.py"}
             for name, path in mods.items() if path.name != "__init__.py"}
    assert circles(graph) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("folder", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "core").rglob("*")
                                          if p.is_dir() and p.name != "__pycache__"
                                          and "templates" not in p.parts) + ["core"])
def test_no_core_folder_is_crowded(folder):
    count = sum(1 for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
    assert count <= MAX_MODULES, f"{folder}/ holds {count} modules"


def test_the_core_names_no_model_and_no_built_in_plugin():
    found = {}
    for path in sorted((ROOT / "core").rglob("*.py")):
        if "testing" in path.relative_to(ROOT / "core").parts:
            continue  # the kit runs the built-in models as its examples
        words = sorted({w.lower() for w in MODEL_WORDS.findall(path.read_text())})
        if words:
            found[str(path.relative_to(ROOT))] = words
    assert found == {}


def builtin_names() -> set[str]:
    """Every entry-point name the three setup.cfg files register in a plugtron.* group."""
    import configparser

    names = set()
    for cfg in (ROOT / "setup.cfg", ROOT / "gpt_plugin/setup.cfg", ROOT / "moe_plugin/setup.cfg"):
        parser = configparser.ConfigParser()
        parser.read(cfg)
        for group, body in parser.items("options.entry_points"):
            if group.startswith("plugtron."):
                names |= {line.split("=")[0].strip() for line in body.splitlines() if "=" in line}
    return names


#: String constants of core/ that equal a built-in entry-point name but mean something else:
#: 'allgather' is also Megatron's --cp-comm-type value, a core mechanism, not the MoE
#: dispatcher. The defaults of every role are ``auto``, answered by selectors
#: (docs/architecture.md "selectors"). This list may only shrink.
STILL_NAMED = {
    "core/config.py": {"allgather"},
    "core/parallel/context_parallel.py": {"allgather"},
    "core/parallel/cp_attention.py": {"allgather"},
}


def test_the_core_names_no_built_in_plugin_by_its_entry_point_name():
    names = builtin_names()
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "core").rglob("*.py")):
        if "testing" in path.relative_to(ROOT / "core").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value in names:
                found.setdefault(str(path.relative_to(ROOT)), set()).add(node.value)
    new = {p: sorted(v - STILL_NAMED.get(p, set())) for p, v in found.items()
           if v - STILL_NAMED.get(p, set())}
    assert not new, f"core/ names built-in plugins: {new} (a selector answers for them)"
    gone = {p: sorted(v - found.get(p, set())) for p, v in STILL_NAMED.items()
            if v - found.get(p, set())}
    assert not gone, f"no longer named, take them off STILL_NAMED: {gone}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def test_the_training_loop_never_reaches_interchange_or_tools():
    """HF / Megatron interchange and the tools (generation, inference, estimate, evaluate) sit
    above the loop: nothing the loop imports, at any depth, is one of them."""
    mods = modules()
    known = set(mods)
    graph = {name: imports_of(name, path, known) for name, path in mods.items()}
    above = ("plugtron.core.interchange", "plugtron.core.tools")
    for start in ("plugtron.core.training.loop", "plugtron.core.checkpoint"):
        bad = sorted(m for m in reachable(graph, start) if m.startswith(above))
        assert bad == [], f"{start} reaches {bad}"
    assert reachable({"a": {"b"}, "b": {"c"}}, "a") == {"b", "c"}  # the walk itself


#: docs/architecture.md's picture of core/, top to bottom.
LAYERS = ("tools", "interchange", "training", "checkpoint", "monitoring", "pipeline", "blocks",
          "parallel", "plugins", "contracts")
#: The imports that still go up the picture (module -> the folder above it), at any depth of
#: the module, TYPE_CHECKING ones included. The list may only shrink: a new upward import
#: moves the shared piece down instead.
UPWARD = {
    ("contracts.activations", "training"),   # recompute plans of the activations contract
    ("contracts.hookspecs", "parallel"),     # TYPE_CHECKING: the real types of hook arguments
    ("contracts.hookspecs", "pipeline"),     # TYPE_CHECKING
    ("contracts.hookspecs", "training"),     # TYPE_CHECKING
    ("contracts.layer_backend", "blocks"),   # the protocol's default methods use the blocks
    ("contracts.layer_backend", "parallel"),
    ("contracts.layers", "plugins"),         # layer types are found through the registry
    ("contracts.model_info", "plugins"),
    ("parallel.context_parallel", "blocks"),
    ("parallel.ddp", "training"),            # the distributed optimizer's bucket shards
    ("parallel.random", "training"),         # the rng tracker registers with recompute
    ("parallel.tensor_parallel", "blocks"),  # the shared linear kernels
    ("parallel.vocab_parallel", "blocks"),
    ("plugins.tokenizers", "checkpoint"),    # a resumed run's saved tokenizer
}


def test_core_folders_import_down_the_picture_but_for_the_listed_exceptions():
    mods = modules()
    known = set(mods)

    def layer(module: str) -> str | None:
        parts = module.split(".")
        in_core = parts[:2] == ["plugtron", "core"] and len(parts) > 2
        return parts[2] if in_core and parts[2] in LAYERS else None

    upward = set()
    for name, path in mods.items():
        source = layer(name)
        for target in imports_of(name, path, known) if source else ():
            above = layer(target)
            if above and LAYERS.index(above) < LAYERS.index(source):
                upward.add((name.removeprefix("plugtron.core."), above))
    assert upward - UPWARD == set(), "new imports up docs/architecture.md's picture"
    assert UPWARD - upward == set(), "gone: take them off UPWARD (and the docs' count)"
