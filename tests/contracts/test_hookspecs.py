"""Every hookspec is documented and has a test named ``test_hook_<name>`` somewhere in tests/."""

from __future__ import annotations

import inspect
import pathlib
import re

import pluggy
import pytest
from plugtron.core.contracts import hookspecs

TESTS = pathlib.Path(__file__).parents[1]


def spec_functions():
    return [(name, fn) for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(fn, "plugtron_spec")]


def test_there_are_contract_and_lifecycle_hooks():
    names = {name for name, _ in spec_functions()}
    assert set(hookspecs.CONTRACT_HOOKS) <= names
    assert {"plugtron_configure", "plugtron_step_end", "plugtron_train_end"} <= names


@pytest.mark.parametrize("name,fn", spec_functions(), ids=lambda v: v if isinstance(v, str) else "")
def test_hookspec_is_documented(name, fn):
    doc = inspect.getdoc(fn) or ""
    assert len(doc.splitlines()) >= 3, f"{name} needs a docstring: purpose, params, when called"
    for param in inspect.signature(fn).parameters:
        assert f":param {param}:" in doc, f"{name} does not document parameter {param!r}"
    assert "Called" in doc, f"{name} must say when and on which ranks it is called"


def test_every_hookspec_has_a_test():
    source = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    defined = set(re.findall(r"def (test_hook_\w+)\(", source))
    missing = [name for name, _ in spec_functions() if f"test_hook_{name}" not in defined]
    assert not missing, f"hookspecs without a test_hook_<name> test: {missing}"


def test_driver_and_transform_hooks_are_firstresult_and_lifecycle_hooks_are_not():
    driver_hooks = {**hookspecs.CONTRACT_HOOKS, **hookspecs.OPTIONAL_DRIVER_HOOKS,
                    **hookspecs.TRANSFORM_HOOKS}
    for name, fn in spec_functions():
        opts = fn.plugtron_spec
        assert opts["firstresult"] == (name in driver_hooks), name
        assert name.startswith("plugtron_") == (name not in driver_hooks), name


def test_hookimpl_may_take_a_subset_of_arguments():
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)

    class Partial:
        @hookspecs.hookimpl
        def model_provider(self, config, pre_process):
            return ("built", config, pre_process)

    pm.register(Partial())
    result = pm.hook.model_provider(config="c", pre_process=True, post_process=False,
                                    vp_stage=None, layer_backend=None, parallel=None)
    assert result == ("built", "c", True)
