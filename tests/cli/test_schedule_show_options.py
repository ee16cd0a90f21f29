"""``plugtron schedule show`` takes a schedule's own options, from flags and from ``--config``
(the outsider's split-backward schedule could only be shown with its defaults)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli

from tests.fake_plugins import fake_distribution

SCHEDULE = '''
from dataclasses import dataclass

from plugtron.api import Action, ConfigSection, hookimpl, opt


@dataclass
class LagOptions:
    lag_forwards: int = opt(0, "--lag-forwards", "Forwards run before the first backward.")


class Lag:
    """GPipe-like when lag is large; one forward then its backward when 0 (one stage)."""

    @hookimpl
    def plugtron_config_sections(self):
        return [ConfigSection("lag", LagOptions)]

    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches, config):
        lag = min(config.lag.lag_forwards, num_microbatches - 1)
        out = [Action("F", m, 0) for m in range(lag + 1)]
        for m in range(num_microbatches):
            out.append(Action("B", m, 0))
            if m + lag + 1 < num_microbatches:
                out.append(Action("F", m + lag + 1, 0))
        return out
'''


@pytest.fixture(scope="module")
def lag(tmp_path_factory):
    with fake_distribution(tmp_path_factory.mktemp("lag"), "plugtron-lag", "plugtron.schedules",
                           "lag=lag_schedule:Lag", "lag_schedule", SCHEDULE):
        yield


def _show(*args):
    return CliRunner().invoke(cli, ["schedule", "show", "--schedule", "lag", "--pp", "1",
                                    "-m", "3", *args])


def test_the_default_of_the_schedules_option(lag):
    result = _show()
    assert result.exit_code == 0, result.output
    assert "rank 0: F0 B0 F1 B1 F2 B2" in result.output


def test_the_schedules_option_as_a_flag(lag):
    result = _show("--lag-forwards", "2")
    assert result.exit_code == 0, result.output
    assert "rank 0: F0 F1 F2 B0 B1 B2" in result.output


def test_the_schedules_option_from_a_config_file(lag, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lag-forwards: 1\n")
    result = _show("--config", str(config))
    assert result.exit_code == 0, result.output
    assert "rank 0: F0 F1 B0 F2 B1 B2" in result.output
    assert "--lag-forwards" in CliRunner().invoke(cli, ["schedule", "show", "--schedule",
                                                        "lag", "--help"]).output


def test_an_option_of_a_schedule_not_selected_is_refused(lag):
    result = CliRunner().invoke(cli, ["schedule", "show", "--pp", "2", "-m", "4",
                                      "--lag-forwards", "1"])
    assert result.exit_code == 2
    assert "--lag-forwards" in result.output
