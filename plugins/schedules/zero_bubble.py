"""Schedule ``zb-h1``: ZB-H1 of "Zero Bubble Pipeline Parallelism" (Qi et al., arXiv
2401.10241).

The backward is split: ``I`` (the input gradient, which the previous stage waits for) and ``W``
(the weight gradients, which nobody waits for). Rank ``r`` of ``P`` runs 1F1B's warmup
(``P - r - 1`` forwards) and 1F1B's order with each ``B`` replaced by its ``I`` and then its
``W``. The input gradients travel back one ``I`` per stage instead of one ``B``, so in the
cooldown, where 1F1B's backwards wait on the next stage, a rank runs the ``W`` while the next
``I`` is on its way: with costs ``F``, ``I``, ``W`` (``B = I + W``) the bubble is
``(P - 1)(F + I)`` per rank (the paper's ``(p - 1)(T_F + T_B - T_W)``) against 1F1B's
``(P - 1)(F + B)``, a third less with all three equal. Every rank holds at most as many
microbatches as under 1F1B (``P - r``). The simulator (free communication) reaches this bound
with each ``W`` right after its ``I``; holding ``W``'s back further only delays the ``I``'s.
"""

from __future__ import annotations

from plugtron.api import Action, ActionListSchedule, ConfigError, hookimpl


def zb_h1_actions(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    warmup = min(pp_size - pp_rank - 1, num_microbatches)
    actions = [Action("F", mb) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        actions += [Action("F", warmup + i), Action("I", i), Action("W", i)]
    for mb in range(num_microbatches - warmup, num_microbatches):
        actions += [Action("I", mb), Action("W", mb)]
    return actions


class ZeroBubbleH1(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches):
        if num_chunks != 1:
            raise ConfigError(f"schedule 'zb-h1' runs one model chunk per pipeline rank; with "
                              f"--vp {num_chunks} a looped zero-bubble schedule is not "
                              f"implemented yet")
        return zb_h1_actions(pp_rank, pp_size, num_microbatches)
