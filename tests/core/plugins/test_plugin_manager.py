"""The per-run plugin manager: drivers, extensions, and exactly one implementation per
contract hook."""

from __future__ import annotations

import pytest
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.manager import build_plugin_manager, new_plugin_manager, verify_contracts
from plugtron.core.plugins.selection import AUTOLOAD_ENV, resolve_schedule

from tests.fake_plugins import install_fake_distribution, remove_path
from tests.utils import tiny_config, train_in_process

EXTENSION = """
from plugtron.core.contracts.hookspecs import hookimpl

class Hello:
    @hookimpl
    def plugtron_configure(self, config):
        config.training.seed = 4242
"""


@pytest.fixture()
def fake_extension(tmp_path):
    install_fake_distribution(tmp_path, "plugtron-hello", "0.3",
                              {"plugtron": {"hello": "fake_hello:Hello"}},
                              {"fake_hello": EXTENSION})
    yield
    remove_path(tmp_path)


def test_selected_drivers_make_every_contract_hook_implemented_once():
    pm = build_plugin_manager(tiny_config())
    names = {name for name, _ in pm.list_name_plugin()}
    assert {"model:gpt", "schedule:no-pipelining", "optimizer:adam", "dataset:mock"} <= names


def test_missing_contract_implementation_is_named():
    pm = new_plugin_manager()
    # forward_backward is optional (the core's executor runs schedule_actions): the
    # schedule's required hook is named instead
    with pytest.raises(PluginError, match="no plugin implements 'schedule_actions'.*schedule"):
        verify_contracts(pm)


def test_duplicate_contract_implementation_is_named():
    class AnotherLoss:
        @hookimpl
        def loss_func(self, loss_mask, output_tensor):
            return None

    with pytest.raises(PluginError, match="'loss_func' is implemented by more than one"):
        build_plugin_manager(tiny_config(), extra_plugins=[AnotherLoss()])


def test_wrappers_do_not_count_as_implementations():
    class Timer:
        def __init__(self):
            self.calls = 0

        @hookimpl(wrapper=True)
        def loss_func(self, loss_mask, output_tensor):
            self.calls += 1
            return (yield)

    timer = Timer()
    pm = build_plugin_manager(tiny_config(), extra_plugins=[timer])
    import torch

    pm.hook.loss_func(loss_mask=torch.ones(1, 2), output_tensor=torch.ones(1, 2))
    assert timer.calls == 1


def test_extensions_autoload_and_can_be_disabled(fake_extension, monkeypatch):
    config = tiny_config()
    pm = build_plugin_manager(config)
    pm.hook.plugtron_configure.call_historic(kwargs={"config": config})
    assert config.training.seed == 4242

    config = tiny_config(p=["no:hello"])
    pm = build_plugin_manager(config)
    assert pm.get_plugin("hello") is None

    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    pm = build_plugin_manager(tiny_config())
    assert pm.get_plugin("hello") is None and pm.get_plugin("logging") is None


def test_bad_disable_syntax():
    with pytest.raises(ConfigError, match="no:NAME"):
        build_plugin_manager(tiny_config(p=["hello"]))


@pytest.mark.parametrize("pp,vp,expected", [(1, None, "no-pipelining"), (2, None, "1f1b"),
                                            (2, 2, "interleaved-1f1b")])
def test_auto_schedule(pp, vp, expected):
    config = tiny_config(pp=pp, vp=vp)
    assert resolve_schedule(config) == expected


ACTIONS_ONLY = """
from plugtron.api import Action, hookimpl


class ActionsOnly:
    @hookimpl
    def schedule_actions(self, num_microbatches):
        return [a for mb in range(num_microbatches) for a in (Action("F", mb), Action("B", mb))]
"""


def test_a_schedule_of_actions_alone_runs_on_the_core_executor(tmp_path):
    install_fake_distribution(tmp_path, "plugtron-actions-only", "0.1",
                              {"plugtron.schedules": {"actions-only": "fake_actions:ActionsOnly"}},
                              {"fake_actions": ACTIONS_ONLY})
    try:
        records, run = train_in_process(tiny_config(schedule="actions-only", train_iters=3),
                                        world=single_process())
        assert "schedule:executor" in {name for name, _ in run.pm.list_name_plugin()}
    finally:
        remove_path(tmp_path)
    expected, _ = train_in_process(tiny_config(train_iters=3), world=single_process())
    # the same order as no-pipelining, executed by the same code: bitwise the same losses
    assert [r["lm_loss"] for r in records] == [r["lm_loss"] for r in expected]
