"""Schedule ``interleaved-zero-bubble``: the ZB paper's ZB-H1 over looped virtual stages, in the
same per-rank order as torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``.

Microbatches go in rounds of ``R = M // max(1, M // P)`` (``M`` must be a multiple of the number
of rounds). Forward ``k`` on a rank runs chunk ``(k // R) % C`` (its next microbatch there), the
backward of step ``k`` chunk ``C - 1 - ((k - warmup) // R) % C``. Rank ``r`` warms up with
``(C - 1) R + P - 1 - r`` forwards (at most ``M C``), then runs ``F``, ``I`` pairs, then the
remaining ``I``'s. The weight halves trail their ``I``'s: from the ``r``-th steady step on, each
step ends with the ``W`` of the oldest ``I`` still without one, and whatever is left runs at
the end. Rank ``r`` thus defers ``r`` weight gradients into the cooldown, where 1F1B idles.
"""

from __future__ import annotations

from plugtron.api import Action, ActionKind, ActionListSchedule, ConfigError, hookimpl


def rounds_of(pp_size: int, num_microbatches: int) -> tuple[int, int]:
    """(rounds, microbatches per round), refusing what torch's schedule refuses."""
    rounds = max(1, num_microbatches // pp_size)
    if num_microbatches % rounds:
        raise ConfigError(f"interleaved-zero-bubble runs the microbatches in {rounds} rounds "
                          f"(microbatches // pp, at least 1); {num_microbatches} microbatches "
                          f"are not a multiple of {rounds}: use a multiple of pp {pp_size}, or "
                          f"fewer microbatches than 2 x pp")
    return rounds, num_microbatches // rounds


def interleaved_zero_bubble_actions(pp_rank: int, pp_size: int, num_chunks: int,
                                    num_microbatches: int) -> list[Action]:
    _, per_round = rounds_of(pp_size, num_microbatches)
    total = num_chunks * num_microbatches
    warmup = min((num_chunks - 1) * per_round + pp_size - 1 - pp_rank, total)

    def forward_chunk(step: int) -> int:
        return (step // per_round) % num_chunks

    def backward_chunk(step: int) -> int:
        return num_chunks - 1 - ((step - warmup) // per_round) % num_chunks

    next_mb = {"F": [0] * num_chunks, "I": [0] * num_chunks, "W": [0] * num_chunks}

    def take(kind: ActionKind, chunk: int) -> Action:
        mb = next_mb[kind][chunk]
        next_mb[kind][chunk] += 1
        return Action(kind, mb, chunk)

    actions: list[Action] = []
    backward_steps: list[int] = []  # the step of each I, oldest first
    weights_done = 0
    for step in range(total + warmup):
        if step < total:
            actions.append(take("F", forward_chunk(step)))
        if step < warmup:
            continue
        actions.append(take("I", backward_chunk(step)))
        backward_steps.append(step)
        if step - warmup >= pp_rank:
            actions.append(take("W", backward_chunk(backward_steps[weights_done])))
            weights_done += 1
    for step in backward_steps[weights_done:]:
        actions.append(take("W", backward_chunk(step)))
    return actions


class InterleavedZeroBubble(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches):
        if num_chunks < 2:
            raise ConfigError("interleaved-zero-bubble needs model chunks: give --vp 2 or more "
                              "(with one chunk per rank, use zb-h1)")
        return interleaved_zero_bubble_actions(pp_rank, pp_size, num_chunks, num_microbatches)
