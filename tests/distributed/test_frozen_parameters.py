"""Frozen parameters (``requires_grad`` False, as a model transform leaves a base model) are
honoured at dp 2 under ddp, the distributed optimizer and fsdp2: they keep their values bitwise,
get no gradient buffer and no optimizer state, and the rest trains as one process does (fp32,
relative 1e-5 on losses and grad norms, 1e-5 absolute on the trained parameters). One pool of 2
ranks for the module."""

from __future__ import annotations

import re

import pytest
import torch
from plugtron.api import hookimpl
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.parallel.sharding import full_tensor
from plugtron.core.training.loop import setup, train

from tests.distributed.dp_helpers import max_param_diff, max_rel_diff, one_thread
from tests.utils import StepRecorder, tiny_config

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

TOL = 1e-5
#: Several buckets, so a frozen parameter between trainable ones would show in their layout.
BASE = {"train_iters": 4, "global_batch_size": 8, "micro_batch_size": 2,
        "ddp_bucket_size": 3000}
#: The embedding and the first layer are frozen; the rest trains.
FROZEN = re.compile(r"embedding|decoder\.layers\.0\.")


class FreezeSome:
    """Extension: freezes part of every chunk the model plugin builds."""

    @hookimpl(wrapper=True)
    def model_provider(self):
        module = yield
        for name, param in module.named_parameters():
            if FROZEN.search(name):
                param.requires_grad_(False)
        return module


def _train(overrides: dict, world=None) -> dict:
    config = tiny_config(**{**BASE, **overrides})
    recorder = StepRecorder()
    run = setup(config, extra_plugins=[recorder, FreezeSome()], world=world)
    named = [(n, p) for chunk in run.model_chunks for n, p in chunk.module.named_parameters()]
    frozen = {n: full_tensor(p).detach().clone() for n, p in named if not p.requires_grad}
    train(run, MetricsLogger(config, rank=1))
    for chunk in run.model_chunks:
        chunk.finish_param_sync()
    buffered = {id(p) for chunk in run.model_chunks
                for buffer in getattr(chunk, "grad_buffers", ()) for p in buffer.params}
    state = run.optimizer.sharded_state_dict()
    return {"losses": [r["lm_loss"] for r in recorder.records],
            "grad_norms": [r["grad_norm"] for r in recorder.records],
            "frozen_names": sorted(frozen),
            "frozen_changed": [n for n, p in named if n in frozen
                               and not torch.equal(full_tensor(p).detach(), frozen[n])],
            "frozen_buffered": [n for n, p in named if n in frozen and id(p) in buffered],
            "frozen_with_state": sorted(set(frozen) & set(state)),
            "trained": {n: full_tensor(p).detach().float().clone() for n, p in named
                        if n not in frozen}}


def _rank_train(rank, world_size, overrides):
    return _train(overrides)


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2, timeout=300)


@pytest.fixture(scope="module")
def reference():
    return _train({}, world=single_process())


def test_the_frozen_part_is_what_the_extension_froze(reference):
    assert "embedding.word_embeddings.weight" in reference["frozen_names"]
    assert reference["frozen_changed"] == reference["frozen_buffered"] == []
    assert reference["frozen_with_state"] == []
    assert reference["trained"] and not set(reference["trained"]) & set(
        reference["frozen_names"])


@pytest.mark.parametrize("variant", [{}, {"use_distributed_optimizer": True},
                                     {"use_torch_fsdp2": True}],
                         ids=["ddp", "distributed-optimizer", "fsdp2"])
def test_dp2_trains_the_rest_like_one_process_and_leaves_the_frozen_part(pool, reference,
                                                                          variant):
    for result in pool.run(_rank_train, variant):
        assert result["frozen_names"] == reference["frozen_names"]
        assert result["frozen_changed"] == [], "a frozen parameter changed"
        assert result["frozen_buffered"] == [], "a frozen parameter has a gradient buffer"
        assert result["frozen_with_state"] == [], "a frozen parameter has optimizer state"
        assert max_rel_diff(result["losses"], reference["losses"]) < TOL
        assert max_rel_diff(result["grad_norms"], reference["grad_norms"]) < TOL
        assert max_param_diff(result["trained"], reference["trained"]) < TOL
