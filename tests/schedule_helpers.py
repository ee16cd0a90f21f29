"""A third-party schedule for tests: a random order that respects the dependencies.

It is built by playing one global random topological order of all ranks' actions and giving each
rank its share, so it is valid but neither 1F1B nor GPipe: the executor must run any such order.
"""

from __future__ import annotations

import random

from plugtron import api
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.pipeline.executor import ActionListSchedule
from plugtron.core.pipeline.plan import Action, dependencies, virtual_stage


def random_valid_orders(pp: int, chunks: int, microbatches: int, seed: int) -> list[list]:
    rng = random.Random(seed)
    stages = pp * chunks
    done: set = set()
    next_forward = [[0] * chunks for _ in range(pp)]  # each chunk's forwards go in order
    pending_backward = [set() for _ in range(pp)]
    lists: list[list] = [[] for _ in range(pp)]
    total = 2 * pp * chunks * microbatches
    while sum(map(len, lists)) < total:
        ready = []
        for rank in range(pp):
            candidates = [Action("F", next_forward[rank][c], c) for c in range(chunks)
                          if next_forward[rank][c] < microbatches]
            candidates += [Action("B", mb, c) for mb, c in sorted(pending_backward[rank])]
            for a in candidates:
                stage = virtual_stage(rank, a.chunk, pp)
                if all(d in done for d in dependencies(a, stage, stages)):
                    ready.append((rank, a))
        rank, a = rng.choice(ready)
        lists[rank].append(a)
        done.add((a.kind, a.microbatch, virtual_stage(rank, a.chunk, pp)))
        if a.kind == "F":
            next_forward[rank][a.chunk] += 1
            pending_backward[rank].add((a.microbatch, a.chunk))
        else:
            pending_backward[rank].discard((a.microbatch, a.chunk))
    return lists


class RandomOrderSchedule(ActionListSchedule):
    """Schedule plugin with nothing but an order: the executor does the rest."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_chunks, num_microbatches):
        return random_valid_orders(pp_size, num_chunks, num_microbatches, self.seed)[pp_rank]


class DeferredWeightsSchedule(api.ActionListSchedule):
    """A third-party split-backward schedule, written against ``plugtron.api`` only: 1F1B's
    order with each ``B`` as an ``I``, and every ``W`` of the iteration after the last ``I`` (in
    reverse microbatch order), so weight gradients are deferred past other microbatches'
    backwards and the grad sync must wait for the last ``W``."""

    @api.hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_microbatches):
        warmup = min(pp_size - pp_rank - 1, num_microbatches)
        actions = [api.Action("F", mb) for mb in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions += [api.Action("F", warmup + i), api.Action("I", i)]
        actions += [api.Action("I", mb)
                    for mb in range(num_microbatches - warmup, num_microbatches)]
        return actions + [api.Action("W", mb) for mb in reversed(range(num_microbatches))]


class VShapeGPipe(api.ActionListSchedule):
    """A third-party V-shape schedule, written against ``plugtron.api`` only: it declares the
    V placement, runs every forward of chunk 0 then of chunk 1, every ``I`` of chunk 1 then of
    chunk 0 (each stage waits for the one after it), and all ``W``'s at the end."""

    @api.hookimpl
    def pipeline_placement(self):
        return api.V_SHAPE

    @api.hookimpl
    def schedule_actions(self, num_microbatches):
        mbs = range(num_microbatches)
        return ([api.Action("F", mb, 0) for mb in mbs] + [api.Action("F", mb, 1) for mb in mbs]
                + [api.Action("I", mb, 1) for mb in mbs] + [api.Action("I", mb, 0) for mb in mbs]
                + [api.Action("W", mb, c) for c in (1, 0) for mb in mbs])
