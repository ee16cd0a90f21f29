"""--reset-attention-mask (with --reset-position-ids) trains like one process under tp 2 and
pp 2: the document numbers reach every stage's attention (fp32, the kit's tolerance)."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_layouts_match


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_packed_documents_under_tp_and_pp(pool):
    assert_layouts_match({"model": "gpt", "reset-attention-mask": True,
                          "reset-position-ids": True},
                         layouts=[{"tp": 2}, {"pp": 2}], pool=pool)
