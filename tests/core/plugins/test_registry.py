"""stevedore registries: unknown, broken and duplicate plugins, lazy listing."""

from __future__ import annotations

import pytest
from plugtron.core.errors import PluginError
from plugtron.core.plugins import registry

from tests.fake_plugins import install_fake_distribution, remove_path

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


def test_listing_is_read_once_and_again_after_any_change(tmp_path, monkeypatch):
    """The installed entry points are kept between calls (a run's set-up asks about a hundred
    times) and read again after a distribution is added, its entry points are rewritten in
    place, or it is removed."""
    reads = []
    real = registry.metadata.entry_points
    monkeypatch.setattr(registry.metadata, "entry_points", lambda: reads.append(1) or real())
    registry.available("schedule")
    before = len(reads)
    registry.available("schedule")
    registry.available("optimizer")
    registry.roles()
    assert len(reads) == before, "nothing changed, yet the metadata was read again"

    try:
        install_fake_distribution(tmp_path, "fake-cache", "1.0",
                                  {"plugtron.schedules": {"cache-a": "fake_good:FakeSchedule"}},
                                  {"fake_good": GOOD})
        assert "cache-a" in {i.name for i in registry.available("schedule")}
        # Rewritten in place (same directory, same file): the listing follows.
        install_fake_distribution(tmp_path, "fake-cache", "1.0",
                                  {"plugtron.schedules": {"cache-bb": "fake_good:FakeSchedule"}},
                                  {"fake_good": GOOD})
        names = {i.name for i in registry.available("schedule")}
        assert "cache-bb" in names and "cache-a" not in names
        assert registry.load("schedule", "cache-bb").__name__ == "FakeSchedule"
    finally:
        remove_path(tmp_path)
    assert "cache-bb" not in {i.name for i in registry.available("schedule")}
