"""A data-parallel wrapper plugin trains the same as one process."""

from __future__ import annotations

from .compare import assert_copies_match, assert_params_close, assert_records_close
from .config import merge_flags, own_flags, world_size_of
from .pool import DistributedPool
from .runs import pool_for, refuse_before_launch, train_run


def assert_wrapper_dp_equivalent(wrapper: str, flags: dict | None = None,
                                 layout: dict | None = None, dp: int = 2, rtol: float = 1e-5,
                                 atol: float = 1e-5, iters: int = 3,
                                 pool: DistributedPool | None = None,
                                 compare_params: bool = True) -> None:
    """``--data-parallel wrapper`` on ``layout`` x dp ``dp`` gives one process's losses, grad
    norms and parameters.

    ``wrapper`` is the entry-point name (group ``plugtron.data_parallel``); ``flags`` adds
    model and wrapper options over the kit's tiny defaults (e.g. ``{"bf16": True}``; the
    wrapper's own options, those of its config sections, go to the wrapper's run only);
    ``layout`` the other parallel sizes (``{"tp": 2}``, ``{"pp": 2}``,
    ``{"expert-model-parallel-size": 2}``; the reference runs without them). Both runs train
    ``iters`` iterations on the same global batch, so a reduction that averages instead of
    summing, drops a shard, or counts a shard twice in the norm shows.

    Tolerance: ``lm_loss`` and ``grad_norm`` relative ``rtol`` (default 1e-5, fp32) per
    iteration; with ``compare_params`` every parameter element after the last step within
    ``atol + rtol * |want|`` (leave it off under bf16/fp16, where a sharding wrapper's fp32
    masters are compared with the reference's rounded weights). ``pool`` must hold the run's
    ranks (``layout`` sizes x ``dp``); without one, a pool is started for the call.
    """
    given = merge_flags(flags or {}, {"train-iters": iters})
    # the wrapper's own options go to its run only: the reference does not select it
    mine = own_flags(given, "data_parallel", wrapper)
    base = {k: v for k, v in given.items() if k not in mine}
    got_flags = merge_flags(given, layout or {}, {"data-parallel": wrapper, "dp": dp})
    world = world_size_of(got_flags)
    refuse_before_launch((base, 1), (got_flags, world))
    with pool_for(world, pool) as p:
        reference = train_run(base, 1, p, gather_params=compare_params)
        got = train_run(got_flags, world, p, gather_params=compare_params)
    what = f"data-parallel wrapper {wrapper!r} on {layout or {}} x dp {dp} against one process"
    assert_records_close(got.records, reference.records, rtol, what)
    if compare_params:
        assert_params_close(assert_copies_match(got.params, rtol, atol, what),
                            assert_copies_match(reference.params, rtol, atol, what), rtol,
                            atol, what)
