"""``--optimizer muon`` under tensor and pipeline parallelism against one process (fp32, the
Newton-Schulz iteration in fp32 too: ``--muon-fp32-matmul-prec high``), on one pool of 2 gloo
ranks: tp 2 duplicated (with and without sequence parallelism) and pp 2; ``blockwise`` is the
approximation it says it is.

Tolerance 1e-5 (relative on losses and grad norms, atol + rtol on every final parameter): only
the order of fp32 sums differs from one process. In bf16 (``medium``, the default) the
iteration rounds those differences to bf16 steps; the figures are in docs/plugins/optimizers.md.
"""

from __future__ import annotations

import pytest
from plugtron.testing.compare import (
    assert_copies_match,
    assert_params_close,
    assert_records_close,
)
from plugtron.testing.config import merge_flags
from plugtron.testing.runs import train_run

FLAGS = {"optimizer": "muon", "muon-fp32-matmul-prec": "high", "lr": 5e-3, "train-iters": 3}
TOL = 1e-5


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2, timeout=300)


@pytest.fixture(scope="module")
def reference(pool):
    return train_run(FLAGS, 1, pool, gather_params=True)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sequence-parallel": True}, {"pp": 2}],
                         ids=["tp2", "tp2-sp", "pp2"])
def test_layout_steps_like_one_process(pool, reference, layout):
    got = train_run(merge_flags(FLAGS, layout), None, pool, gather_params=True)
    what = f"muon {layout} against one process"
    assert_records_close(got.records, reference.records, TOL, what)
    assert_params_close(assert_copies_match(got.params, TOL, TOL, what), reference.params, TOL,
                        TOL, what)


def test_blockwise_is_an_approximation(pool, reference):
    got = train_run(merge_flags(FLAGS, {"tp": 2, "muon-tp-mode": "blockwise"}), None, pool)
    assert got.records[-1]["lm_loss"] < got.records[0]["lm_loss"]
    assert got.records[-1]["lm_loss"] != pytest.approx(reference.records[-1]["lm_loss"],
                                                       rel=TOL)
