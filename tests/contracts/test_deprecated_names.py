"""A plugin written against last week's contract keeps working for one more version, says what
to rename, and ``plugins check`` reports it (docs/migration.md, contract 3)."""

from __future__ import annotations

import pytest
from plugtron.core.contracts import versions
from plugtron.core.plugins import check, registry

from tests.fake_plugins import fake_distribution
from tests.utils import tiny_config, train_in_process

#: An optimizer as the outsider wrote it on 2026-12-03: the main-parameter protocol's private
#: names of the time, found in the source.
OLD_OPTIMIZER = '''
from plugtron.api import TorchOptimizer, adamw_factory, hookimpl

CALLS = {"prepare": 0, "publish": 0}


class OldNamesOptimizer(TorchOptimizer):
    def _prepare_main_grads(self):
        CALLS["prepare"] += 1
        return super()._prepare_main_grads()

    def _publish_main_params(self):
        CALLS["publish"] += 1
        super()._publish_main_params()


class OldNames:
    @hookimpl
    def optimizer_state_per_param(self, config):
        return 2

    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        return OldNamesOptimizer(model_chunks, config, parallel, adamw_factory(config))
'''


@pytest.fixture(scope="module")
def old_optimizer(tmp_path_factory):
    with fake_distribution(tmp_path_factory.mktemp("old_optimizer"), "plugtron-old-names",
                           "plugtron.optimizers", "old-names=old_names_opt:OldNames",
                           "old_names_opt", OLD_OPTIMIZER, version="0.3.0"):
        yield


def test_old_names_train_exactly_like_the_new_ones(old_optimizer):
    with pytest.warns(versions.PlugtronDeprecationWarning,
                      match="overrides _prepare_main_grads, which contract 3 calls "
                            "prepare_main_grads"):
        old, _ = train_in_process(tiny_config(train_iters=3, optimizer="old-names"))
    import old_names_opt

    new, _ = train_in_process(tiny_config(train_iters=3, optimizer="adam"))
    assert [r["lm_loss"] for r in old] == [r["lm_loss"] for r in new]  # bitwise
    assert old_names_opt.CALLS == {"prepare": 3, "publish": 3}


def test_plugins_check_reports_the_deprecated_use(old_optimizer):
    info = next(i for i in registry.available("optimizer") if i.name == "old-names")
    problems = check.check_plugin(info)
    assert problems and all(p.warning for p in problems)  # reported, not failed
    text = "\n".join(map(str, problems))
    assert "deprecated:" in text and "_publish_main_params" in text


def test_a_plugin_can_require_the_contract():
    from plugtron.api import CONTRACT_VERSION, PluginError, require_contract

    require_contract(CONTRACT_VERSION)
    with pytest.raises(PluginError, match=f"contract {CONTRACT_VERSION + 1}; this plugtron has "
                                          f"contract {CONTRACT_VERSION}: upgrade plugtron"):
        require_contract(CONTRACT_VERSION + 1)
