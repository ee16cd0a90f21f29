"""Schedule ``zb-h1``: ZB-H1 of "Zero Bubble Pipeline Parallelism" (Qi et al., arXiv
2401.10241), in the order of torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``
with one stage per rank.

The backward is split: ``I`` (the input gradient, which the previous stage waits for) and ``W``
(the weight gradients, which nobody waits for). Rank ``r`` of ``P`` runs 1F1B's warmup
(``P - r - 1`` forwards), then 1F1B's order with each ``B`` as an ``I``, but its first ``r``
``I``'s go without their ``W``: from then on each ``I`` is followed by the ``W`` of the ``I``
``r`` places before it, and the last ``r`` ``W``'s run at the end. Deferring them lets the later
ranks send their input gradients back sooner, and in the cooldown, where 1F1B's ranks wait for
backwards, the earlier ranks run their ``W``'s. With costs ``F``, ``I``, ``W`` the bubble per rank
is the paper's ``(P - 1)(F + I - W)`` (for ``W <= F + I``) against 1F1B's ``(P - 1)(F + I +
W)``; every rank holds at most ``P`` microbatches, what 1F1B's first rank holds.
"""

from __future__ import annotations

from plugtron.api import Action, ActionListSchedule, ConfigError, hookimpl


def zb_h1_actions(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    warmup = min(pp_size - pp_rank - 1, num_microbatches)
    actions = [Action("F", mb) for mb in range(warmup)]
    deferred = pp_rank  # W's held back behind the I's
    for mb in range(num_microbatches):
        if warmup + mb < num_microbatches:
            actions.append(Action("F", warmup + mb))
        actions.append(Action("I", mb))
        if mb >= deferred:
            actions.append(Action("W", mb - deferred))
    first_left = max(0, num_microbatches - deferred)
    return actions + [Action("W", mb) for mb in range(first_left, num_microbatches)]


class ZeroBubbleH1(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches):
        if num_chunks != 1:
            raise ConfigError(f"schedule 'zb-h1' runs one model chunk per pipeline rank; with "
                              f"--vp {num_chunks} use interleaved-zero-bubble")
        return zb_h1_actions(pp_rank, pp_size, num_microbatches)
