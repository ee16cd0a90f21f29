"""stevedore registries: unknown, broken and duplicate plugins, lazy listing."""

from __future__ import annotations

import pytest
from plugtron.core.errors import PluginError
from plugtron.core.plugins import registry

from .fake_plugins import install_fake_distribution, remove_path

GOOD = """
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.pipeline.plan import Action

class FakeSchedule:
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches, config):
        return [Action("F", 0), Action("B", 0)]
"""
BROKEN = "raise RuntimeError('fake plugin exploded on import')\n"


@pytest.fixture()
def fake_plugins(tmp_path):
    install_fake_distribution(
        tmp_path, "fake-schedules", "1.2.3",
        {"plugtron.schedules": {"fake": "fake_good:FakeSchedule",
                                "fake-broken": "fake_broken:Thing",
                                "no-pipelining": "fake_good:FakeSchedule"}},
        {"fake_good": GOOD, "fake_broken": BROKEN})
    yield tmp_path
    remove_path(tmp_path)


def test_builtin_names_are_listed_with_their_distribution():
    names = {(i.name, i.distribution) for i in registry.available("schedule")}
    assert ("no-pipelining", "plugtron") in names
    assert ("gpt", "plugtron-gpt") in {(i.name, i.distribution)
                                       for i in registry.available("model")}


def test_listing_does_not_import(fake_plugins):
    infos = {i.name: i for i in registry.available("schedule")}
    assert infos["fake-broken"].origin == "fake-schedules 1.2.3"  # listed, never imported


def test_load_known_plugin(fake_plugins):
    cls = registry.load("schedule", "fake")
    assert cls.__name__ == "FakeSchedule"


def test_unknown_name_lists_available_names_and_distributions():
    with pytest.raises(PluginError) as err:
        registry.load("schedule", "does-not-exist")
    message = str(err.value)
    assert "unknown schedule 'does-not-exist'" in message
    assert "no-pipelining (plugtron" in message


def test_broken_plugin_names_distribution_version_and_exception(fake_plugins):
    with pytest.raises(PluginError) as err:
        registry.load("schedule", "fake-broken")
    message = str(err.value)
    assert "fake-schedules 1.2.3" in message
    assert "fake plugin exploded on import" in message
    # A broken plugin elsewhere does not break loading another one.
    assert registry.load("optimizer", "adam").__name__ == "Adam"
    assert registry.check("schedule", "fake") is None
    assert "exploded" in registry.check("schedule", "fake-broken")


def test_duplicate_name_from_two_distributions(fake_plugins):
    with pytest.raises(PluginError) as err:
        registry.load("schedule", "no-pipelining")
    assert "more than one distribution" in str(err.value)
    assert "fake-schedules 1.2.3" in str(err.value)


def test_unknown_role():
    with pytest.raises(PluginError, match="unknown plugin role"):
        registry.available("nope")
