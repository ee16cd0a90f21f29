"""The check a third-party token dispatcher passes (the dispatcher contract is plugtron-moe's,
so its kit check is too; it is built on plugtron.testing's)::

    from plugtron_moe.testing import assert_dispatcher_matches

    def test_my_dispatcher_trains_like_one_process():
        assert_dispatcher_matches("mine")
"""

from __future__ import annotations

from plugtron.testing import assert_layouts_match

#: A GPT with four experts per layer, top-2, balancing and z losses on: the same model under
#: every layout and dispatcher.
DISPATCHER_FLAGS = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 0.01,
                    "moe-z-loss-coeff": 0.001}

#: Expert parallelism over 2 and 4 ranks, and ep 2 inside tp 2 with sequence parallelism (the
#: dispatcher then gets sequence-sharded tokens and enters and leaves tp itself).
DISPATCHER_LAYOUTS = (
    {"expert-model-parallel-size": 2, "dp": 2},
    {"expert-model-parallel-size": 4, "dp": 4},
    {"expert-model-parallel-size": 2, "dp": 2, "tp": 2, "sequence-parallel": True},
)


def assert_dispatcher_matches(name: str, flags: dict | None = None,
                              layouts=DISPATCHER_LAYOUTS, rtol: float = 1e-5, iters: int = 3,
                              pool=None) -> None:
    """Dispatcher ``name`` (entry point in ``plugtron.moe_dispatchers``) trains like one process
    under every layout: losses and grad norms within relative ``rtol`` per iteration (fp32).
    ``flags`` are merged over :data:`DISPATCHER_FLAGS`; ``pool`` as for
    ``plugtron.testing.assert_layouts_match`` (it must hold the largest layout's world: 4
    ranks for the defaults)."""
    base = {**DISPATCHER_FLAGS, **(flags or {}), "moe-token-dispatcher-type": name}
    assert_layouts_match(base, layouts=layouts, rtol=rtol, iters=iters, pool=pool)
