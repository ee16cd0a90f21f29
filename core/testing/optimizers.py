"""An optimizer plugin steps the same under data parallelism as on one rank."""

from __future__ import annotations

from .compare import assert_copies_match, assert_params_close, assert_records_close
from .config import merge_flags
from .pool import DistributedPool
from .runs import pool_for, refuse_before_launch, train_run


def assert_optimizer_dp_equivalent(optimizer: str, flags: dict | None = None, dp: int = 2,
                                   rtol: float = 1e-5, atol: float = 1e-5, iters: int = 3,
                                   pool: DistributedPool | None = None) -> None:
    """``--optimizer optimizer`` on dp ``dp`` gives dp 1's losses, grad norms and parameters.

    ``optimizer`` is the entry-point name (group ``plugtron.optimizers``); ``flags`` adds model
    and optimizer options over the kit's tiny defaults (e.g. ``{"overlap-grad-reduce": True}``).
    Both runs train ``iters`` iterations on the same global batch (which ``dp`` x
    ``micro-batch-size`` must divide), so a sharded optimizer state or a data-parallel reduction
    that drops, repeats or mis-scales a gradient shows.

    Tolerance (fp32): ``lm_loss`` and ``grad_norm`` relative ``rtol`` (default 1e-5) per
    iteration; every parameter element after the last step within ``atol + rtol * |want|``
    (``torch.testing.assert_close``; atol default 1e-5: Adam's normalised step turns the float
    noise of a near-zero gradient into differences of about 1e-6). ``pool`` must hold ``dp`` ranks; without one, a pool is
    started for the call.
    """
    base = merge_flags(flags or {}, {"optimizer": optimizer, "train-iters": iters})
    refuse_before_launch((base, 1), (merge_flags(base, {"dp": dp}), dp))
    with pool_for(dp, pool) as p:
        reference = train_run(base, 1, p, gather_params=True)
        got = train_run(merge_flags(base, {"dp": dp}), dp, p, gather_params=True)
    what = f"optimizer {optimizer!r} on dp {dp} against dp 1"
    assert_records_close(got.records, reference.records, rtol, what)
    assert_params_close(assert_copies_match(got.params, rtol, atol, what),
                        assert_copies_match(reference.params, rtol, atol, what), rtol, atol,
                        what)
