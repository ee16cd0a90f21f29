"""The core calls each ``DataParallelChunk`` method when docs/plugins/data-parallel.md says, with
any optimizer: a wrapper's ``start_param_sync`` ran only under the distributed optimizer, so a
local-SGD wrapper's parameter averaging silently never ran."""

from __future__ import annotations

import pytest
from plugtron.api import hookimpl

from tests.utils import tiny_config

PROTOCOL = ("zero_grad_buffer", "start_grad_sync", "finish_grad_sync", "scale_grads",
            "start_param_sync", "finish_param_sync")


class RecordingChunk:
    """The wrapped chunk, with every protocol call logged."""

    def __init__(self, chunk, log: list):
        self._chunk, self._log = chunk, log

    def __getattr__(self, name):
        value = getattr(self._chunk, name)
        if name in PROTOCOL:
            def logged(*args, **kwargs):
                self._log.append(name)
                return value(*args, **kwargs)
            return logged
        return value

    def __call__(self, *args, **kwargs):
        return self._chunk(*args, **kwargs)


class Recorder:
    def __init__(self):
        self.log: list[str] = []

    @hookimpl(wrapper=True)
    def wrap_model_chunk(self, config, module, parallel, shard_gradients):
        chunk = yield
        return RecordingChunk(chunk, self.log)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "distributed-adam"])
def test_each_step_zeroes_reduces_scales_steps_then_syncs_parameters(optimizer):
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.training.loop import setup, train

    recorder = Recorder()
    config = tiny_config(train_iters=2, optimizer=optimizer)
    run = setup(config, extra_plugins=[recorder])
    train(run, MetricsLogger(config, rank=1))
    steps = " ".join(recorder.log).split("zero_grad_buffer")[1:]
    assert len(steps) >= 2
    for step in steps[:2]:
        calls = step.split()
        assert calls.index("start_grad_sync") < calls.index("finish_grad_sync") \
            < calls.index("scale_grads") < calls.index("start_param_sync"), calls
        assert calls.count("start_param_sync") == 1, calls
