"""Every layout trains like one process: the check a model plugin passes."""

from __future__ import annotations

from .compare import assert_records_close
from .config import merge_flags, world_size_of
from .pool import DistributedPool
from .runs import pool_for, refuse_before_launch, train_run

#: tp 2, pp 2, pp 2 x vp 2, dp 2 (2 ranks each) and tp 2 x pp 2 x dp 2 (8 ranks). dp is what the
#: world leaves after tp x pp x cp, so each layout's world is the product of its sizes.
DEFAULT_LAYOUTS = (
    {"tp": 2},
    {"pp": 2},
    {"pp": 2, "vp": 2},
    {"dp": 2},
    {"tp": 2, "pp": 2, "dp": 2},
)


def layout_name(layout: dict) -> str:
    """``{"tp": 2, "pp": 2}`` -> ``"tp2-pp2"`` (``"single-process"`` for ``{}``)."""
    return "-".join(f"{k}{v}" for k, v in merge_flags(layout).items()) or "single-process"


def assert_layouts_match(flags: dict, layouts=DEFAULT_LAYOUTS, rtol: float = 1e-5,
                         iters: int = 3, pool: DistributedPool | None = None) -> None:
    """Each layout's losses and grad norms equal the single-process run's within ``rtol``.

    ``flags`` names the model and its options by flag name (``{"model": "my-model",
    "num-layers": 4}``) over the kit's tiny defaults; each layout is a dict of flags merged on
    top (``{"tp": 2, "pp": 2, "dp": 2}``; dp defaults to 1, so a layout runs on tp x pp x cp x dp
    ranks). Every run trains ``iters`` iterations with the same global batch, so the losses
    (token-weighted) do not depend on the split over microbatches and data-parallel ranks.

    Tolerance: relative ``rtol`` (default 1e-5, fp32) per iteration on ``lm_loss`` and
    ``grad_norm``. ``pool`` must hold the largest layout's world; without one, a pool of that
    size is started for the call. Raises ``AssertionError`` naming the layout, metric and
    iteration that differ.
    """
    base = merge_flags(flags, {"train-iters": iters})
    worlds = [world_size_of(merge_flags(base, layout)) for layout in layouts]
    refuse_before_launch((base, 1), *((merge_flags(base, layout), world)
                                      for layout, world in zip(layouts, worlds)))
    with pool_for(max(worlds, default=1), pool) as p:
        reference = train_run(base, 1, p).records
        for layout, world in zip(layouts, worlds):
            got = train_run(merge_flags(base, layout), world, p).records
            assert_records_close(got, reference, rtol,
                                 f"{layout_name(layout)} against one process")
