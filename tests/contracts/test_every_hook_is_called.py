"""Every contract hook, and every model-transform hook, is called by the core through the plugin
manager: an extension that wraps it sees each call (so a wrapper of ``loss_func`` runs, as one
of ``forward_step`` does)."""

from __future__ import annotations

import collections

from plugtron.api import hookimpl
from plugtron.core.contracts import hookspecs
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup, train

from tests.transform_helpers import installed_test_transforms
from tests.utils import StepRecorder, tiny_config, train_in_process

#: The hooks the core calls through the plugin manager, each with one implementation per call.
WRAPPED_HOOKS = {**hookspecs.CONTRACT_HOOKS, **hookspecs.TRANSFORM_HOOKS}


def _wrapping_extension(calls: collections.Counter):
    """An extension with a ``wrapper=True`` implementation of every contract and transform
    hook."""

    def wrapper_of(name):
        def wrap(**kwargs):
            calls[name] += 1
            return (yield)
        return wrap

    namespace = {}
    for name in WRAPPED_HOOKS:
        params = list(vars(hookspecs)[name].__code__.co_varnames[
            :vars(hookspecs)[name].__code__.co_argcount])
        source = (f"def {name}(self, {', '.join(params)}):\n"
                  f"    return (yield from _wrap_{name}({', '.join(f'{p}={p}' for p in params)}))\n")
        scope = {f"_wrap_{name}": wrapper_of(name)}
        exec(source, scope)  # noqa: S102 - the hook's own parameter names, for pluggy
        namespace[name] = hookimpl(wrapper=True)(scope[name])
    return type("WrapsEveryContractHook", (), namespace)()


def test_an_extension_wrapping_each_contract_hook_sees_it_called(tmp_path):
    calls: collections.Counter = collections.Counter()
    with installed_test_transforms(tmp_path):  # a transform, so its hook has a caller
        config = tiny_config(train_iters=1, model_transforms=["record", "freeze"])
        run = setup(config, extra_plugins=[_wrapping_extension(calls)], world=single_process())
        train(run, MetricsLogger(config, rank=1))
    missing = [name for name in WRAPPED_HOOKS if calls[name] == 0]
    assert not missing, f"hooks the core never called: {missing}"
    assert calls["loss_func"] == calls["forward_step"] > 0
    assert calls["transform_model_chunk"] == 2  # one chunk, two transforms


def test_a_plain_loss_closure_still_works_and_is_deprecated(recwarn):
    """Contract 2's ``partial(loss_func, loss_mask)`` trains the same, with a deprecation."""
    from functools import partial

    from plugtron.api import PlugtronDeprecationWarning
    from plugtron.core.contracts import versions
    from plugtron_gpt.gpt.plugin import loss_func as gpt_loss_func

    class PlainClosure:
        @hookimpl(wrapper=True)
        def forward_step(self, data_iterator, model):
            output, closure = yield
            return output, partial(gpt_loss_func, closure.loss_mask)

    versions.USES.clear()
    with_closure, _ = train_in_process(tiny_config(train_iters=2))
    recorder = StepRecorder()
    config = tiny_config(train_iters=2)
    run = setup(config, extra_plugins=[recorder, PlainClosure()])
    train(run, MetricsLogger(config, rank=1))
    records = recorder.records
    assert [r["lm_loss"] for r in records] == [r["lm_loss"] for r in with_closure]
    assert any(issubclass(w.category, PlugtronDeprecationWarning)
               and "plugtron.api.loss_closure(loss_mask)" in str(w.message) for w in recwarn)
