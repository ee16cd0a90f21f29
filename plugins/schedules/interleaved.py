"""Schedule ``interleaved-1f1b``: 1F1B over virtual pipeline stages (Megatron's interleaving).

Each rank holds ``C = --vp`` model chunks. Microbatches go through the chunks in groups of
``G = --microbatch-group-size-per-vp-stage`` (default ``pp``): the table lists, for each group,
chunk 0's microbatches of the group, then chunk 1's, and so on. Forward ``k`` runs table entry
``k``; backward ``k`` runs the same microbatch on chunk ``C - 1 - chunk``. Rank ``r`` of ``P``
warms up with ``(P - r - 1) * 2 + (C - 1) * G`` forwards (at most all ``M * C``), then alternates
forward and backward, then drains. The bubble shrinks by about ``C`` against 1F1B.
"""

from __future__ import annotations

from plugtron.api import Action, ActionListSchedule, ConfigError, hookimpl


def group_size(config, pp_size: int) -> int:
    return config.parallel.microbatch_group_size_per_vp_stage or pp_size


def check_microbatches(pp_size: int, num_microbatches: int, group: int) -> None:
    """Megatron's constraints: ``P <= G <= M`` and a last, partial group of 0 or >= P."""
    if not pp_size <= group <= num_microbatches:
        raise ConfigError(
            f"interleaved-1f1b needs pp {pp_size} <= microbatch group size {group} "
            f"(--microbatch-group-size-per-vp-stage, default pp) <= microbatches per step "
            f"{num_microbatches} (global batch / (micro batch x dp)); raise "
            f"--global-batch-size or lower --micro-batch-size")
    rest = num_microbatches % group
    if rest and rest < pp_size:
        raise ConfigError(
            f"interleaved-1f1b: {num_microbatches} microbatches leave a last group of {rest} "
            f"(group size {group}), fewer than pp {pp_size}; use a number of microbatches "
            f"that is a multiple of {group} or leaves at least {pp_size}")


def interleaved_actions(pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int,
                        group: int) -> list[Action]:
    table = [(mb, chunk) for start in range(0, num_microbatches, group)
             for chunk in range(num_chunks)
             for mb in range(start, min(start + group, num_microbatches))]
    total = len(table)
    warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * group, total)

    def forward(k):
        return Action("F", table[k][0], table[k][1])

    def backward(k):
        return Action("B", table[k][0], num_chunks - 1 - table[k][1])

    actions = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [forward(warmup + i), backward(i)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


class Interleaved1F1B(ActionListSchedule):
    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches, config):
        group = group_size(config, pp_size)
        check_microbatches(pp_size, num_microbatches, group)
        return interleaved_actions(pp_rank, pp_size, num_chunks, num_microbatches, group)
