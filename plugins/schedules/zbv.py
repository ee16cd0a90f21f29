"""Schedule ``zbv``: ZB-V of "Zero Bubble Pipeline Parallelism" (Qi et al., arXiv 2401.10241,
section 6), in the same per-rank order as torch.distributed.pipelining's
``ScheduleZBVZeroBubble``.

The V-shape placement: rank ``r`` of ``P`` holds stage ``r`` (chunk 0) and stage
``2P - 1 - r`` (chunk 1), so a microbatch goes down the ranks through the chunk 0's and back up
through the chunk 1's, and the loss is computed on rank 0 beside the embedding. With ``F = I =
W`` every rank is busy from its first forward to the end: the ``W``'s fill what would be the
bubble, with the activation memory of 1F1B (``2P`` microbatch-chunks at most).

Rank ``r``'s order: ``2(P - r) - 1`` forwards of chunk 0; ``r`` pairs (``F`` chunk 1, ``F``
chunk 0); ``P - r`` triples (``F``, ``I``, ``W`` of chunk 1); the steady state, each step a
chunk-0 ``F`` (while microbatches remain), ``I``, ``W`` and a chunk-1 ``F``, ``I``, ``W``; then
``r`` pairs of ``I`` (chunk 0, chunk 1) and ``P - r`` pairs (``I``, ``W``) of chunk 0; then the
chunk-1 ``W``'s left and the chunk-0 ones. Fewer than ``2P - 1`` microbatches run the order of
``2P - 1`` with the missing microbatches' actions left out.
"""

from __future__ import annotations

from plugtron.api import Action, ActionKind

from .v_shape import VShapeSchedule


def zbv_actions(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    padded = max(2 * pp_size - 1, num_microbatches)
    count = {(kind, chunk): 0 for kind in "FIW" for chunk in (0, 1)}
    actions: list[Action] = []

    def add(kind: ActionKind, chunk: int, mb: int | None = None) -> None:
        if mb is None:
            mb = count[(kind, chunk)]
            count[(kind, chunk)] += 1
        actions.append(Action(kind, mb, chunk))

    for _ in range(2 * (pp_size - pp_rank) - 1):
        add("F", 0)
    for _ in range(pp_rank):
        add("F", 1)
        add("F", 0)
    for _ in range(pp_size - pp_rank):
        add("F", 1)
        add("I", 1)
        add("W", 1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < padded:
        if count[("F", 0)] < padded:
            add("F", 0)
        add("I", 0)
        add("W", 0)
        add("F", 1)
        add("I", 1)
        add("W", 1)
    for _ in range(pp_rank):
        add("I", 0)
        add("I", 1)
    for _ in range(pp_size - pp_rank):
        add("I", 0)
        add("W", 0)
    for chunk in (1, 0):
        while count[("W", chunk)] < count[("I", chunk)]:
            add("W", chunk)
    return [a for a in actions if a.microbatch < num_microbatches]


class ZeroBubbleV(VShapeSchedule):
    name = "zbv"

    def v_actions(self, pp_rank, pp_size, num_microbatches):
        return zbv_actions(pp_rank, pp_size, num_microbatches)
