"""``--layer-backend te`` under the split-backward schedules on gloo ranks, on the CPU stand-in
of tests/fake_transformer_engine.py (installed inside each rank): ``zb-h1`` and ``zbv`` at pp 2
(and ``zb-h1`` at tp 2 with sequence parallelism, and at dp 2 with overlapped gradient
reduction) train like ``1f1b`` with the te linears' weight gradients deferred through
transformer-engine's delayed wgrad, and a TE without it (weight gradients at ``I``) matches too.
fp32, no dropout; losses, grad norms and the validation loss relative 1e-5, as
tests/distributed/test_zero_bubble.py.
"""

from __future__ import annotations

import collections
from unittest import mock

import pytest
from plugtron.plugins.layer_backends.te_wgrad import DelayedWeightGrads
from plugtron.testing.compare import assert_records_close, assert_value_close
from plugtron.testing.runs import _rank_train, refuse_before_launch

from tests import fake_transformer_engine

FLAGS = {"model": "gpt", "num-layers": 4, "layer-backend": "te", "pp": 2, "train-iters": 3}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4)


def _train_on_fake_te(rank, world_size, flags, delay_wgrad):
    """One rank of a run with the stand-in TE, counting the GEMMs TE queued and plugtron's W's
    popped (every one must be popped by the end). It wraps the kit's own rank function
    (``train_run`` starts its ranks without a way to patch inside them)."""
    counts: collections.Counter = collections.Counter()
    take, pop = DelayedWeightGrads.take_ticket, DelayedWeightGrads.pop

    def counted_take(self):
        counts["queued"] += 1
        return take(self)

    def counted_pop(self, ticket):
        counts["popped"] += 1
        return pop(self, ticket)

    with fake_transformer_engine.installed(delay_wgrad), \
            mock.patch.object(DelayedWeightGrads, "take_ticket", counted_take), \
            mock.patch.object(DelayedWeightGrads, "pop", counted_pop):
        result = _rank_train(rank, world_size, flags, evaluate=True)
    return result, dict(counts)


def _run(pool, schedule, delay_wgrad, flags):
    flags = {**FLAGS, **flags, "schedule": schedule}
    world_size = 2 * flags.get("tp", 1) * flags.get("dp", 1)
    with fake_transformer_engine.installed(delay_wgrad):
        refuse_before_launch((flags, world_size))
    return pool.run(_train_on_fake_te, flags, delay_wgrad, world_size=world_size)


#: 1f1b's (records, validation loss) per (delay_wgrad, flags), within this module
_REFERENCE: dict = {}


def _assert_matches_1f1b(pool, schedule, delay_wgrad, flags=None):
    flags = flags or {}
    key = (delay_wgrad, repr(sorted(flags.items())))
    if key not in _REFERENCE:
        ranks = _run(pool, "1f1b", delay_wgrad, flags)
        assert all(not counts for _, counts in ranks)  # no split: nothing queued
        _REFERENCE[key] = (ranks[0][0].records, ranks[0][0].valid_loss)
    ranks = _run(pool, schedule, delay_wgrad, flags)
    records, valid = _REFERENCE[key]
    what = f"{schedule} against 1f1b, te (delay_wgrad={delay_wgrad}) {flags}"
    assert_records_close(ranks[0][0].records, records, 1e-5, what)
    assert_value_close(ranks[0][0].valid_loss, valid, 1e-5, f"{what}: validation loss")
    return [counts for _, counts in ranks]


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_te_split_schedules_match_1f1b_with_deferred_te_weight_gradients(pool, schedule):
    for counts in _assert_matches_1f1b(pool, schedule, delay_wgrad=True):
        # every rank's te linears queued GEMMs at I and its W's popped each of them
        assert counts["queued"] > 0 and counts["popped"] == counts["queued"]


def test_te_zb_h1_matches_1f1b_on_a_te_whose_forward_always_captures_its_store(pool):
    # TE 2.4 to 2.15: only the store's state when the backward runs decides
    for counts in _assert_matches_1f1b(pool, "zb-h1", delay_wgrad="always"):
        assert counts["queued"] > 0 and counts["popped"] == counts["queued"]


def test_te_zb_h1_matches_1f1b_under_tp_2_and_sequence_parallel(pool):
    # TE's GEMMs on plugtron's gathered / scattered activations; the queued GEMM needs no
    # collective at W (its input was gathered at forward)
    counts = _assert_matches_1f1b(pool, "zb-h1", True,
                                  {"tp": 2, "sequence-parallel": True, "global-batch-size": 8})
    assert all(c["queued"] > 0 and c["popped"] == c["queued"] for c in counts)


def test_te_zb_h1_matches_1f1b_with_overlapped_data_parallel_reduce(pool):
    # dp 2, small buckets reduced from the parameters' post-accumulate hooks: the te weights'
    # gradients reach them at W, through autograd (TE's backward_dw would bypass the hooks)
    counts = _assert_matches_1f1b(pool, "zb-h1", True,
                                  {"dp": 2, "overlap-grad-reduce": True,
                                   "ddp-bucket-size": 4096, "global-batch-size": 8})
    assert all(c["queued"] > 0 and c["popped"] == c["queued"] for c in counts)


def test_a_te_without_delayed_wgrad_matches_1f1b_with_weight_gradients_at_i(pool):
    assert all(not counts for counts in _assert_matches_1f1b(pool, "zb-h1", delay_wgrad=False))
