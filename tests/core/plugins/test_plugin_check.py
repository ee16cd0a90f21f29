"""``plugtron plugins check``: every kind of hook problem, on fake distributions, and a clean
pass on the built-in plugins."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.plugins import check as plugin_check

from tests.fake_plugins import install_fake_distribution, remove_path

PLUGINS = '''
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.pipeline.executor import ActionListSchedule
from plugtron.core.pipeline.plan import Action


class InheritsForwardBackward(ActionListSchedule):
    """Clean: forward_backward comes from the base class."""

    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches, config):
        return [Action("F", 0), Action("B", 0)]


class NoForwardBackward:
    """Clean too: forward_backward is optional (the core's executor runs these actions)."""

    @hookimpl
    def schedule_actions(self, pp_rank, num_microbatches):
        return []


class NoScheduleActions:
    @hookimpl
    def forward_backward(self, forward_step_func, data_iterator, model):
        return []


class ExtraParameter(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, pp_rank, num_stages):
        return []


class MisspelledOptimizer:
    @hookimpl
    def build_optimiser(self, config, model_chunks):
        return None


class UnmarkedOptimizer:
    def build_optimizer(self, config, model_chunks):
        return None


class NoisyExtension:
    def plugtron_step_ends(self, iteration, metrics):  # misspelled, and not marked either
        pass

    def plugtron_train_start(self, config, state):  # right name, but pluggy ignores it
        pass

    @hookimpl(wrapper=True)
    def loss_func(self, loss_mask, output_tensor):  # a wrapper that never yields
        return None

    @hookimpl
    def build_optimizer(self, config):  # a contract hook, not wrapped: a second implementation
        return None

    @hookimpl
    def plugtron_configure(self, config):  # fine
        pass


class LayerWithOddNames:
    """Layers have no hooks: only imported, never hook-checked."""

    def plugtron_whatever(self):
        pass

    def activation_bytes(self, shape):
        return 0


class LayerWithoutActivationBytes:
    """Works, but plugtron estimate cannot count what it keeps: a warning."""


class ConverterOffersWithoutDropping:
    droppable_parts = {"mtp": "the multi-token prediction layers"}


class ConverterOffersAndDrops(ConverterOffersWithoutDropping):
    def drop_part(self, config, part):
        pass
'''

ENTRY_POINTS = {
    "plugtron.schedules": {"fake-clean": "fake_check:InheritsForwardBackward",
                           "fake-no-fb": "fake_check:NoForwardBackward",
                           "fake-no-actions": "fake_check:NoScheduleActions",
                           "fake-extra": "fake_check:ExtraParameter",
                           "fake-broken": "fake_check_broken:Schedule",
                           "no-pipelining": "fake_check:InheritsForwardBackward"},
    "plugtron.optimizers": {"fake-misspelled": "fake_check:MisspelledOptimizer",
                            "fake-unmarked": "fake_check:UnmarkedOptimizer"},
    "plugtron": {"fake-noisy": "fake_check:NoisyExtension"},
    "plugtron.layers": {"fake-layer": "fake_check:LayerWithOddNames",
                        "fake-no-bytes": "fake_check:LayerWithoutActivationBytes",
                        "fake-broken-layer": "fake_check_broken:Layer"},
    "plugtron.converters": {"fake-no-drop": "fake_check:ConverterOffersWithoutDropping",
                            "fake-drops": "fake_check:ConverterOffersAndDrops"},
}


@pytest.fixture()
def fakes(tmp_path):
    install_fake_distribution(tmp_path, "fake-checks", "2.0", ENTRY_POINTS,
                              {"fake_check": PLUGINS,
                               "fake_check_broken": "raise ImportError('no such wheel')\n"})
    yield
    remove_path(tmp_path)


def problems(name: str) -> list[str]:
    [(_, found)] = [(info, found) for info, found in
                    plugin_check.check_plugins(plugin_check.installed_plugins([name]))
                    if info.distribution == "fake-checks"]
    return [str(p) for p in found]


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_inherited_contract_hooks_count(fakes):
    assert problems("fake-clean") == []


def test_a_missing_contract_hook_is_named(fakes):
    assert problems("fake-no-fb") == []
    assert problems("fake-no-actions") == [
        "schedule 'fake-no-actions' (fake-checks 2.0) hook 'schedule_actions': not implemented: every "
        "schedule driver must implement it"]


def test_a_parameter_the_hookspec_does_not_have(fakes):
    [line] = problems("fake-extra")
    assert line.startswith("schedule 'fake-extra' (fake-checks 2.0) hook 'schedule_actions': "
                           "parameter 'num_stages' is not in the hookspec; the hook has: pp_rank")


def test_a_misspelled_hookimpl_gets_the_closest_name(fakes):
    assert problems("fake-misspelled") == [
        "optimizer 'fake-misspelled' (fake-checks 2.0) hook 'build_optimiser': is not a plugtron "
        "hook, so nothing calls it; did you mean 'build_optimizer'?",
        "optimizer 'fake-misspelled' (fake-checks 2.0) hook 'build_optimizer': not implemented: "
        "every optimizer driver must implement it"]


def test_an_unmarked_contract_hook_is_missing_with_a_hint(fakes):
    [line] = problems("fake-unmarked")
    assert "'build_optimizer': not implemented" in line and "not marked @hookimpl" in line


def test_extension_problems_one_line_each(fakes):
    found = problems("fake-noisy")
    prefix = "extension 'fake-noisy' (fake-checks 2.0) hook "
    assert found == [
        prefix + "'build_optimizer': belongs to the optimizer driver; any other plugin may only "
                 "wrap it (@hookimpl(wrapper=True)), else a run has two implementations",
        prefix + "'loss_func': is a wrapper but not a generator function: it must `yield`",
        prefix + "'plugtron_step_ends': is not a plugtron hook, so nothing calls it; did you mean "
                 "'plugtron_step_end'?",
        prefix + "'plugtron_train_start': is not marked @hookimpl, so pluggy never calls it"]


def test_roles_without_hooks_are_only_imported(fakes):
    assert problems("fake-layer") == []
    assert problems("fake-broken-layer") == [
        "layer 'fake-broken-layer' (fake-checks 2.0): failed to import "
        "(fake_check_broken:Layer): ImportError: no such wheel"]


def test_a_layer_type_without_activation_bytes_is_a_warning(fakes):
    [line] = problems("fake-no-bytes")
    assert line.startswith("warning: layer 'fake-no-bytes' (fake-checks 2.0) hook "
                           "'activation_bytes': not defined: plugtron estimate and train's "
                           "memory check count this layer's activations as 0")
    result = invoke(["plugins", "check", "fake-no-bytes"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "ok  layer 'fake-no-bytes' (fake-checks 2.0)"
    assert result.output.splitlines()[-1] == "1 plugin(s) checked, 0 problem(s), 1 warning(s)"
    listed = invoke(["plugins", "list", "--check"]).output
    line = next(x for x in listed.splitlines() if x.strip().startswith("fake-no-bytes "))
    assert line.split() == ["fake-no-bytes", "fake-checks", "2.0", "ok"]
    assert "        warning: layer 'fake-no-bytes'" in listed


def test_a_converter_that_offers_parts_must_drop_them(fakes):
    assert problems("fake-drops") == []
    [line] = problems("fake-no-drop")
    assert "hook 'drop_part': not defined: droppable_parts offers mtp" in line


def test_a_name_two_distributions_register(fakes):
    [line] = problems("no-pipelining")
    assert "registered by more than one distribution (fake-checks 2.0, plugtron " in line


def test_cli_check_reports_problems_and_exits_2(fakes):
    result = invoke(["plugins", "check", "fake-extra"])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "schedule 'fake-extra' (fake-checks 2.0) hook 'schedule_actions': parameter "
        "'num_stages' is not in the hookspec; the hook has: pp_rank, pp_size, num_chunks, "
        "num_microbatches, config",
        "1 plugin(s) checked, 1 problem(s)"]
    result = invoke(["plugins", "check"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "ok  schedule 'fake-clean' (fake-checks 2.0)" in result.output
    assert "schedule 'fake-broken' (fake-checks 2.0): failed to import" in result.output


def test_cli_list_check_exits_2_on_problems(fakes):
    result = invoke(["plugins", "list", "--check"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = next(x for x in result.output.splitlines()
                if x.strip().startswith("fake-no-actions "))
    assert line.split() == ["fake-no-actions", "fake-checks", "2.0", "FAILED", "(1)"]
    assert "        schedule 'fake-no-actions' (fake-checks 2.0) hook 'schedule_actions'" \
        in result.output


def test_unknown_name():
    result = invoke(["plugins", "check", "nope"])
    assert result.exit_code == 2 and "no installed plugin is called 'nope'" in result.output
    result = invoke(["plugins", "check", "adam", "nope", "sgd", "nix"])
    assert result.exit_code == 2 and "called 'nix', 'nope';" in result.output


def test_several_names_are_checked_in_one_run():
    result = invoke(["plugins", "check", "adam", "1f1b"])
    assert result.exit_code == 0, result.output
    assert "ok  optimizer 'adam'" in result.output and "ok  schedule '1f1b'" in result.output
    assert "2 plugin(s) checked, 0 problem(s)" in result.output


def test_built_in_plugins_pass():
    result = invoke(["plugins", "check"])
    assert result.exit_code == 0, result.output
    for line in ("ok  model 'gpt' (plugtron-gpt", "ok  schedule 'interleaved-1f1b' (plugtron",
                 "ok  optimizer 'distributed-adam' (plugtron", "ok  extension 'logging'"):
        assert line in result.output
    assert invoke(["plugins", "list", "--check"]).exit_code == 0
