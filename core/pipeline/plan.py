"""The actions a pipeline schedule executes, as data: one source of truth for the run and for
``plugtron schedule show``.

A schedule is a list of actions per pipeline rank: forward ``F`` or backward ``B`` of one
microbatch on one model chunk. Chunk ``c`` on rank ``p`` is virtual stage ``c * pp + p`` of the
model; forward of a microbatch on virtual stage ``s`` needs that microbatch's forward on
``s - 1``, its backward needs the backward on ``s + 1`` and its own forward.

:func:`simulate` plays all ranks' lists against those dependencies (each rank strictly in its
order, any action as soon as its inputs exist). It gives the timeline that ``schedule show``
prints and draws, and the order of communication steps the executor posts; a set of lists that
cannot finish is rejected with the cycle's first waits named.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.core.errors import ConfigError
from plugtron.core.plugins.signatures import declared_arguments

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".c{self.chunk}" if self.chunk else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "microbatch": self.microbatch, "chunk": self.chunk}


def virtual_stage(pp_rank: int, chunk: int, pp_size: int) -> int:
    return chunk * pp_size + pp_rank


def stage_owner(stage: int, pp_size: int) -> tuple[int, int]:
    """(pp rank, chunk) that holds virtual stage ``stage``."""
    return stage % pp_size, stage // pp_size


def actions_of_all_ranks(schedule_actions, pp_size: int, num_chunks: int,
                         num_microbatches: int, config) -> list[list[Action]]:
    """Call a ``schedule_actions`` implementation once per pipeline rank. Like pluggy, pass only
    the arguments it declares."""
    wanted = declared_arguments(schedule_actions)
    out = []
    for rank in range(pp_size):
        kwargs = {"pp_rank": rank, "pp_size": pp_size, "num_chunks": num_chunks,
                  "num_microbatches": num_microbatches, "config": config}
        out.append(list(schedule_actions(**{k: v for k, v in kwargs.items()
                                            if wanted is None or k in wanted})))
    return out


def check_actions(per_rank: list[list[Action]], num_chunks: int, num_microbatches: int,
                  forward_only: bool = False) -> None:
    """Each rank must run every (microbatch, chunk) forward once and, unless ``forward_only``,
    its backward once after it; each chunk's forwards in microbatch order, because a chunk's data
    iterator yields microbatches in order."""
    expected = {(mb, c) for mb in range(num_microbatches) for c in range(num_chunks)}
    for rank, actions in enumerate(per_rank):
        seen: dict[str, list] = {FORWARD: [], BACKWARD: []}
        forwards_done = set()
        for a in actions:
            if not isinstance(a, Action) or a.kind not in seen:
                raise ConfigError(f"rank {rank}: {a!r} is not an Action of kind 'F' or 'B'")
            if (a.microbatch, a.chunk) not in expected:
                raise ConfigError(f"rank {rank}: {a} names a microbatch or chunk outside "
                                  f"{num_microbatches} microbatches x {num_chunks} chunks")
            if a.kind == BACKWARD and (a.microbatch, a.chunk) not in forwards_done:
                raise ConfigError(f"rank {rank}: {a} runs before its forward")
            seen[a.kind].append((a.microbatch, a.chunk))
            if a.kind == FORWARD:
                forwards_done.add((a.microbatch, a.chunk))
        for kind in (FORWARD,) if forward_only else (FORWARD, BACKWARD):
            got = seen[kind]
            if len(got) != len(expected) or set(got) != expected:
                raise ConfigError(f"rank {rank}: the schedule must run each of the "
                                  f"{num_microbatches} microbatches x {num_chunks} chunks "
                                  f"{'forward' if kind == FORWARD else 'backward'} exactly once; "
                                  f"got {len(got)} {kind} actions")
        for c in range(num_chunks):
            order = [mb for mb, chunk in seen[FORWARD] if chunk == c]
            if order != sorted(order):
                raise ConfigError(f"rank {rank}: chunk {c} runs its forwards in the order "
                                  f"{order}; each chunk must take microbatches in order")


def check_schedule(schedule_actions, pp_size: int, num_chunks: int, num_microbatches: int,
                   config) -> list[list[Action]]:
    """Everything about a schedule that can fail, before a run starts: its own constraints, the
    shape of its lists, and that they finish for training and for evaluation. Returns the
    lists."""
    per_rank = actions_of_all_ranks(schedule_actions, pp_size, num_chunks, num_microbatches,
                                    config)
    check_actions(per_rank, num_chunks, num_microbatches)
    simulate(per_rank, num_chunks)
    simulate([forward_only_actions(a) for a in per_rank], num_chunks)
    return per_rank


def forward_only_actions(actions: list[Action]) -> list[Action]:
    """Evaluation runs the forwards of a schedule in its order and drops the backwards."""
    return [a for a in actions if a.kind == FORWARD]


def dependencies(action: Action, stage: int, num_stages: int) -> list[tuple]:
    """Keys ``(kind, microbatch, virtual stage)`` of the actions ``action`` waits for."""
    if action.kind == FORWARD:
        return [(FORWARD, action.microbatch, stage - 1)] if stage > 0 else []
    deps = [(FORWARD, action.microbatch, stage)]
    if stage < num_stages - 1:
        deps.append((BACKWARD, action.microbatch, stage + 1))
    return deps


@dataclass(frozen=True)
class Slot:
    """One action placed on the timeline of its rank."""

    action: Action
    rank: int
    start: float
    end: float


def simulate(per_rank: list[list[Action]], num_chunks: int, forward_time: float = 1.0,
             backward_time: float = 2.0) -> list[list[Slot]]:
    """Place every action at the earliest time its rank is free and its inputs exist.

    Communication is free. Raises ``ConfigError`` when the lists wait on each other forever.
    """
    pp = len(per_rank)
    num_stages = pp * num_chunks
    finished: dict[tuple, float] = {}
    position = [0] * pp
    clock = [0.0] * pp
    slots: list[list[Slot]] = [[] for _ in range(pp)]
    remaining = sum(len(actions) for actions in per_rank)
    while remaining:
        progressed = False
        for rank, actions in enumerate(per_rank):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                stage = virtual_stage(rank, action.chunk, pp)
                deps = dependencies(action, stage, num_stages)
                if any(d not in finished for d in deps):
                    break
                start = max([clock[rank]] + [finished[d] for d in deps])
                cost = forward_time if action.kind == FORWARD else backward_time
                finished[(action.kind, action.microbatch, stage)] = clock[rank] = start + cost
                slots[rank].append(Slot(action, rank, start, start + cost))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ConfigError("the schedule's per-rank orders wait on each other forever: "
                              + _describe_waits(per_rank, position, finished, num_chunks))
    return slots


def _describe_waits(per_rank, position, finished, num_chunks) -> str:
    pp = len(per_rank)
    waits = []
    for rank, actions in enumerate(per_rank):
        if position[rank] == len(actions):
            continue
        action = actions[position[rank]]
        stage = virtual_stage(rank, action.chunk, pp)
        for kind, mb, dep_stage in dependencies(action, stage, pp * num_chunks):
            if (kind, mb, dep_stage) not in finished:
                owner, chunk = stage_owner(dep_stage, pp)
                waits.append(f"rank {rank} at {action} needs {Action(kind, mb, chunk)} on "
                             f"rank {owner}")
                break
    return "; ".join(waits)


def peak_stored(actions: list[Action]) -> int:
    """Most microbatch-chunks whose forward ran and whose backward has not yet: the
    activations a rank holds at its peak."""
    held = peak = 0
    for action in actions:
        held += 1 if action.kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(slots: list[list[Slot]]) -> float:
    """Idle share of ``ranks x makespan``."""
    makespan = max((s.end for rank in slots for s in rank), default=0.0)
    if makespan == 0:
        return 0.0
    busy = sum(s.end - s.start for rank in slots for s in rank)
    return 1.0 - busy / (len(slots) * makespan)
