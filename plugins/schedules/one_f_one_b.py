"""Schedule ``1f1b``: one forward, one backward (PipeDream-flush, Megatron's default for pp > 1).

Rank ``r`` of ``P`` runs ``min(P - r - 1, M)`` warmup forwards, then alternates one forward and
one backward, then drains the remaining backwards. It holds at most ``P - r`` microbatches'
activations, against ``M`` for GPipe, with the same bubble.
"""

from __future__ import annotations

from plugtron.api import Action, ActionListSchedule, ConfigError, hookimpl


def one_f_one_b_actions(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    warmup = min(pp_size - pp_rank - 1, num_microbatches)
    actions = [Action("F", mb) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return actions


class OneFOneB(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches):
        if num_chunks != 1:
            raise ConfigError(f"schedule '1f1b' runs one model chunk per pipeline rank; with "
                              f"--vp {num_chunks} use --schedule interleaved-1f1b (or auto)")
        return one_f_one_b_actions(pp_rank, pp_size, num_microbatches)
