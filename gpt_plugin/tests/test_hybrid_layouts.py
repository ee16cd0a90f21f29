"""The Hybrid model trains like one process under every layout, and its checkpoints reshard
(fp32, dropout 0, the kit's tiny defaults; relative 1e-5 on lm_loss and grad_norm).

Mamba sizes: hidden 32 and head dim 8 give 8 heads in 2 groups, so tp 2 holds 4 heads and one
group per rank; chunk 6 does not divide the sequence of 16 (the padded last chunk is exercised).
"""

from __future__ import annotations

import pytest
from plugtron.core.plugins import registry
from plugtron.testing import assert_checkpoint_reshards, assert_layouts_match

MAMBA = {"model": "hybrid", "mamba-state-dim": 8, "mamba-head-dim": 8, "mamba-num-groups": 2,
         "mamba-chunk-size": 6, "normalization": "RMSNorm"}
HYBRID = {**MAMBA, "hybrid-layer-pattern": "M*-M", "num-layers": 4}

LAYOUTS = [
    {"tp": 2},
    {"tp": 2, "sequence-parallel": True},
    {"pp": 2, "hybrid-layer-pattern": "M*|-M"},          # explicit segments
    {"pp": 2, "hybrid-layer-pattern": "M*-|M"},          # uneven: 3 + 1 layers
    {"pp": 2, "vp": 2},                                  # even split, one layer per chunk
    {"dp": 2, "use-distributed-optimizer": True},
]


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_hybrid_matches_one_process_under_every_layout(pool):
    assert_layouts_match(HYBRID, layouts=LAYOUTS, pool=pool)


def test_untied_output_layer_and_rope(pool):
    flags = {**HYBRID, "untie-embeddings-and-output-weights": True,
             "position-embedding-type": "rope"}
    assert_layouts_match(flags, layouts=[{"tp": 2}, {"pp": 2, "hybrid-layer-pattern": "M|*-M"}],
                         pool=pool)


def test_checkpoint_reshards_from_tp_to_an_uneven_pipeline(pool):
    assert_checkpoint_reshards(HYBRID, save_layout={"tp": 2, "sequence-parallel": True},
                               load_layout={"pp": 2, "hybrid-layer-pattern": "M*-|M"},
                               pool=pool)


def test_checkpoint_reshards_from_interleaved_to_distributed_optimizer(pool):
    assert_checkpoint_reshards(HYBRID, save_layout={"pp": 2, "vp": 2},
                               load_layout={"dp": 2, "use-distributed-optimizer": True},
                               pool=pool)


def _moe_installed() -> bool:
    for info in registry.available("layer"):
        try:
            if getattr(registry.load("layer", info.name), "symbol", None) == "E":
                return True
        except Exception:  # noqa: BLE001 - a broken layer plugin just means no E here
            continue
    return False


HYBRID_MOE = {**HYBRID, "hybrid-layer-pattern": "ME*E", "num-experts": 4, "moe-router-topk": 2}
EP2 = {"expert-model-parallel-size": 2, "dp": 2}  # ep borrows from dp


@pytest.mark.skipif(not _moe_installed(), reason="no layer type for E (plugtron-moe) installed")
def test_moe_layers_by_symbol(pool):
    """E layers (plugtron-moe, found by symbol) next to M and *: tp 2, pp 2 (ME | *E) and
    expert parallelism 2 (dropless: no capacity factor) equal one process."""
    assert_layouts_match(HYBRID_MOE, layouts=[{"tp": 2}, {"pp": 2}, EP2], pool=pool)


@pytest.mark.skipif(not _moe_installed(), reason="no layer type for E (plugtron-moe) installed")
def test_moe_hybrid_checkpoint_reshards_from_ep2_to_tp2(pool):
    assert_checkpoint_reshards(HYBRID_MOE, save_layout=EP2, load_layout={"tp": 2}, pool=pool)
