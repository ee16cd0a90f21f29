"""Schedule ``dualpipev``: DeepSeek's DualPipe folded onto the V-shape placement (DualPipeV), in
the same per-rank order as torch.distributed.pipelining's ``ScheduleDualPipeV``.

Rank ``r`` of ``P`` holds stage ``r`` (chunk 0) and stage ``2P - 1 - r`` (chunk 1), as in
``zbv``. With ``M >= 2P`` microbatches, rank ``r``:

1. ``2(P - r - 1)`` forwards of chunk 0;
2. ``r + 1`` pairs of forwards (chunk 0, chunk 1);
3. ``P - r - 1`` times: ``I`` of chunk 1, the oldest pending ``W``, ``F`` of chunk 1;
4. ``M - 2P + r + 1`` times: a chunk-0 forward with a whole chunk-1 backward, then a chunk-1
   forward with a whole chunk-0 backward (DualPipe overlaps each such pair; here they run one
   after the other, forward first);
5. ``P - r - 1`` times: a chunk-1 backward, then a chunk-1 forward with a chunk-0 backward;
6. ``r + 1`` times: a chunk-1 then a chunk-0 backward, split into ``I`` (with its ``W``
   deferred) from the middle on;
7. ``P - r - 1`` times: the oldest pending ``W``, then a chunk-0 backward (split as in 6);
8. the pending ``W``'s.

A whole backward ``B`` counts as its microbatch's ``I`` and ``W``; deferred ``W``'s run oldest
first.
"""

from __future__ import annotations

from collections import deque

from plugtron.api import Action, ConfigError

from .v_shape import VShapeSchedule


def dualpipe_v_actions(pp_rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    P, r = pp_size, pp_rank
    forwards = [0, 0]
    backwards = [0, 0]
    pending: deque[tuple[int, int]] = deque()  # (chunk, microbatch) of I's without their W
    actions: list[Action] = []

    def forward(chunk: int) -> None:
        actions.append(Action("F", forwards[chunk], chunk))
        forwards[chunk] += 1

    def backward(chunk: int, split: bool = False) -> None:
        mb = backwards[chunk]
        backwards[chunk] += 1
        actions.append(Action("I" if split else "B", mb, chunk))
        if split:
            pending.append((chunk, mb))

    def weight() -> None:
        if pending:
            chunk, mb = pending.popleft()
            actions.append(Action("W", mb, chunk))

    for _ in range(2 * (P - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(P - r - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(num_microbatches - 2 * P + r + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(P - r - 1):
        backward(1)
        forward(1)
        backward(0)
    split = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == steps // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(P - r - 1):
        weight()
        backward(0, split)
    for _ in range(r + 1):
        weight()
    return actions


class DualPipeV(VShapeSchedule):
    name = "dualpipev"

    def v_actions(self, pp_rank, pp_size, num_microbatches):
        if num_microbatches < 2 * pp_size:
            raise ConfigError(f"dualpipev needs at least as many microbatches as stages (2 x pp "
                              f"= {2 * pp_size}); got {num_microbatches}: raise "
                              f"--global-batch-size or lower --micro-batch-size")
        return dualpipe_v_actions(pp_rank, pp_size, num_microbatches)
