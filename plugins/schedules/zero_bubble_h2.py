"""Schedule ``zb-h2``: ZB-H2 of "Zero Bubble Pipeline Parallelism" (Qi et al., arXiv
2401.10241), the zero-bubble schedule within the paper's memory limit of ``2p - 1``
microbatches per rank.

Rank ``r`` of ``P`` warms up with ``2(P - r) - 1`` forwards (at most ``M``): the extra forwards
fill the time 1F1B's warmup waits for the first backward. Then each step runs an ``I``, a ``W``
and the next forward, with rank ``r`` holding ``2r`` ``W``'s back (the ``W`` of microbatch ``k``
follows the ``I`` of microbatch ``k + 2r``); the held-back ``W``'s fill the cooldown, where 1F1B
waits for the later ranks' backwards. With ``M >= 2P - 1`` microbatches and costs ``F``, ``I``,
``W`` the idle time inside each rank's span is the paper's ``(P - 1)(F + I - 2W)`` (zero for
``F = I = W``), and every rank holds at most ``2P - 1`` microbatches, the paper's limit.
"""

from __future__ import annotations

from plugtron.api import Action, ActionListSchedule, ConfigError, hookimpl


def zb_h2_actions(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    warmup = min(2 * (pp_size - pp_rank) - 1, num_microbatches)
    held_back = 2 * pp_rank
    actions = [Action("F", mb) for mb in range(warmup)]
    next_forward, waiting = warmup, []
    for mb in range(num_microbatches):
        actions.append(Action("I", mb))
        waiting.append(mb)
        if len(waiting) > held_back:
            actions.append(Action("W", waiting.pop(0)))
        if next_forward < num_microbatches:
            actions.append(Action("F", next_forward))
            next_forward += 1
    return actions + [Action("W", mb) for mb in waiting]


class ZeroBubbleH2(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches):
        if num_chunks != 1:
            raise ConfigError(f"schedule 'zb-h2' runs one model chunk per pipeline rank; with "
                              f"--vp {num_chunks} use interleaved-zero-bubble")
        return zb_h2_actions(pp_rank, pp_size, num_microbatches)
