"""docs/layer_backend.md is the method reference of ``plugtron.api.LayerBackend``: every public
method and attribute with its signature and full docstring, generated from the class. Regenerate
it with ``python -m tests.docs.test_layer_backend_doc`` after changing the interface."""

from __future__ import annotations

import inspect
import pathlib
import re

from plugtron.api import LayerBackend

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "layer_backend.md"

HEAD = """# The layer backend, method by method

A model builds every tensor-parallel block through the `LayerBackend` the run selected
(`--layer-backend`; the built-in ones are `local` and `te`), so a model never imports a backend.
This page lists what a backend gives a model and what a backend author implements (the methods
marked *abstract*). Generated from core/contracts/layer_backend.py by
`python -m tests.docs.test_layer_backend_doc`; tests/docs/test_layer_backend_doc.py keeps it current.
"""


def _members():
    for name, member in vars(LayerBackend).items():
        if name.startswith("_") and name != "__init__":
            continue
        yield name, member


def render() -> str:
    lines = [HEAD, "## What every backend keeps", "", inspect.getdoc(inspect.getmodule(
        LayerBackend)).split("Contracts every backend keeps:", 1)[1].strip(), ""]
    lines += ["## Members", ""]
    for name, member in _members():
        function = member.fget if isinstance(member, property) else getattr(member, "__func__",
                                                                               member)
        if callable(function):
            signature = str(inspect.signature(function)).replace("(self, ", "(").replace(
                "(self)", "()").replace("(cls)", "()").replace("'", "")
            abstract = " *(abstract)*" if getattr(function, "__isabstractmethod__", False) else ""
            kind = "property" if isinstance(member, property) else "method"
            lines += [f"### `{name}{'' if kind == 'property' else signature}`{abstract}", ""]
            lines += [inspect.getdoc(function) or "(undocumented)", ""]
        else:
            comment = re.search(rf"#: (.*)\n\s+{name} = ", inspect.getsource(LayerBackend))
            lines += [f"### `{name} = {member!r}`", "",
                      comment.group(1) if comment else "(undocumented)", ""]
    return "\n".join(lines)


def test_the_method_reference_is_current():
    assert DOC.read_text() == render(), \
        "docs/layer_backend.md is stale: python -m tests.docs.test_layer_backend_doc"


def test_every_method_is_documented():
    undocumented = [line for line in render().splitlines() if line == "(undocumented)"]
    assert undocumented == []


if __name__ == "__main__":
    DOC.write_text(render())
