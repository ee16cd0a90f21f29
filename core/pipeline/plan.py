"""The actions a pipeline schedule executes, as data: one source of truth for the run and for
``plugtron schedule show``.

A schedule is a list of actions per pipeline rank: forward ``F`` or backward ``B`` of one
microbatch on one model chunk, or ``B`` split in two: ``I`` (the gradient of the stage input,
what the previous stage waits for) and ``W`` (that microbatch's weight gradients on that chunk,
see ``core/contracts/weight_grads.py``). Chunk ``c`` on rank ``p`` is a virtual stage of the
model: ``c * pp + p`` under the looped placement, the V's ``p`` / ``2 * pp - 1 - p`` under the
V-shape one (``core/pipeline/layout.py``); forward of a microbatch on virtual stage ``s`` needs that
microbatch's forward on ``s - 1``, its backward (``B`` or ``I``) needs the input gradient from
``s + 1`` (``B`` or ``I`` there) and its own forward; a ``W`` needs its own ``I``, and may run
any time after it.

:func:`simulate` plays all ranks' lists against those dependencies (each rank strictly in its
order, any action as soon as its inputs exist). It gives the timeline that ``schedule show``
prints and draws, and the order of communication steps the executor posts; a set of lists that
cannot finish is rejected with the cycle's first waits named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from plugtron.core.errors import ConfigError

# virtual_stage and stage_owner are used by callers of this module too: the placement's rule
from plugtron.core.parallel.context import LOOPED, stage_owner, virtual_stage
from plugtron.core.plugins.signatures import declared_arguments

#: ``F`` forward, ``B`` whole backward, ``I`` its input-gradient half, ``W`` its weight half.
ActionKind = Literal["F", "B", "I", "W"]
FORWARD: Final = "F"
BACKWARD: Final = "B"
BACKWARD_INPUT: Final = "I"
BACKWARD_WEIGHT: Final = "W"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
#: Kinds that produce the stage input's gradient (what the previous stage receives).
INPUT_GRADIENT_KINDS = (BACKWARD, BACKWARD_INPUT)


@dataclass(frozen=True)
class Action:
    kind: ActionKind  # "F" forward, "B" backward, "I" input-gradient half, "W" weight half
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".c{self.chunk}" if self.chunk else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "microbatch": self.microbatch, "chunk": self.chunk}


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


def placement_of(schedule, pp_size: int, config) -> str:
    """The placement ``schedule`` (a schedule plugin object, or a plugin manager's ``hook``)
    declares through its optional ``pipeline_placement`` hook; ``looped`` without one."""
    hook = getattr(schedule, "pipeline_placement", None)
    if hook is None:
        return LOOPED
    wanted = declared_arguments(hook)
    kwargs = {"pp_size": pp_size, "config": config}
    value = hook(**{k: v for k, v in kwargs.items() if wanted is None or k in wanted})
    return LOOPED if value is None else value


def check_actions(per_rank: list[list[Action]], num_chunks: int, num_microbatches: int,
                  forward_only: bool = False) -> None:
    """Each rank must run every (microbatch, chunk) forward once and, unless ``forward_only``,
    its backward once after it: a ``B``, or an ``I`` and later a ``W``; each chunk's forwards in
    microbatch order, because a chunk's data iterator yields microbatches in order."""
    expected = {(mb, c) for mb in range(num_microbatches) for c in range(num_chunks)}
    for rank, actions in enumerate(per_rank):
        seen: dict[str, list] = {FORWARD: [], BACKWARD: []}
        forwards_done = set()
        inputs_done: set = set()
        weights_left: set = set()
        for a in actions:
            if not isinstance(a, Action) or a.kind not in KINDS:
                raise ConfigError(f"rank {rank}: {a!r} is not an Action of kind 'F', 'B', 'I' "
                                  f"or 'W'")
            key = (a.microbatch, a.chunk)
            if key not in expected:
                raise ConfigError(f"rank {rank}: {a} names a microbatch or chunk outside "
                                  f"{num_microbatches} microbatches x {num_chunks} chunks")
            if a.kind in INPUT_GRADIENT_KINDS and key not in forwards_done:
                raise ConfigError(f"rank {rank}: {a} runs before its forward")
            if a.kind == BACKWARD_WEIGHT:
                if key not in weights_left:
                    raise ConfigError(f"rank {rank}: {a} runs before its I (a W computes the "
                                      f"weight gradients the microbatch's I left), or twice")
                weights_left.discard(key)
                continue
            if a.kind == BACKWARD_INPUT:
                if key in inputs_done:
                    raise ConfigError(f"rank {rank}: {a} runs twice")
                inputs_done.add(key)
                weights_left.add(key)
            # B and I both count as the microbatch's backward
            seen[BACKWARD if a.kind == BACKWARD_INPUT else a.kind].append(key)
            if a.kind == FORWARD:
                forwards_done.add(key)
        if weights_left and not forward_only:
            left = ", ".join(str(Action(BACKWARD_WEIGHT, mb, c)) for mb, c in sorted(weights_left))
            raise ConfigError(f"rank {rank}: the weight gradients of {len(weights_left)} split "
                              f"backward(s) are left over at the end: no {left} after their I")
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
                   config, placement: str = LOOPED) -> list[list[Action]]:
    """Everything about a schedule that can fail, before a run starts: its own constraints, the
    shape of its lists, and that they finish for training and for evaluation. Returns the
    lists."""
    per_rank = actions_of_all_ranks(schedule_actions, pp_size, num_chunks, num_microbatches,
                                    config)
    check_actions(per_rank, num_chunks, num_microbatches)
    simulate(per_rank, num_chunks, placement=placement)
    simulate([forward_only_actions(a) for a in per_rank], num_chunks, placement=placement)
    return per_rank


def forward_only_actions(actions: list[Action]) -> list[Action]:
    """Evaluation runs the forwards of a schedule in its order and drops the backwards."""
    return [a for a in actions if a.kind == FORWARD]


def dependencies(action: Action, stage: int, num_stages: int) -> list[tuple]:
    """Keys ``(kind, microbatch, virtual stage)`` of the actions ``action`` waits for. An ``I``
    finishes under the key of ``B`` too: both deliver the stage input's gradient."""
    if action.kind == FORWARD:
        return [(FORWARD, action.microbatch, stage - 1)] if stage > 0 else []
    if action.kind == BACKWARD_WEIGHT:
        return [(BACKWARD_INPUT, action.microbatch, stage)]
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
             backward_time: float = 2.0, input_time: float | None = None,
             weight_time: float | None = None, placement: str = LOOPED,
             action_cost: Callable[[int, Action], float] | None = None) -> list[list[Slot]]:
    """Place every action at the earliest time its rank is free and its inputs exist.

    ``I`` and ``W`` cost half of ``backward_time`` each unless given. ``action_cost(rank,
    action)``, when given, is each action's own cost instead (e.g. measured per rank and chunk:
    the first and last stages carry the embedding and the loss). Communication is free.
    Raises ``ConfigError`` when the lists wait on each other forever.
    """
    costs = {FORWARD: forward_time, BACKWARD: backward_time,
             BACKWARD_INPUT: backward_time / 2 if input_time is None else input_time,
             BACKWARD_WEIGHT: backward_time / 2 if weight_time is None else weight_time}
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
                stage = virtual_stage(rank, action.chunk, pp, placement)
                deps = dependencies(action, stage, num_stages)
                if any(d not in finished for d in deps):
                    break
                start = max([clock[rank]] + [finished[d] for d in deps])
                cost = (costs[action.kind] if action_cost is None
                        else action_cost(rank, action))
                finished[(action.kind, action.microbatch, stage)] = clock[rank] = start + cost
                if action.kind == BACKWARD_INPUT:
                    finished[(BACKWARD, action.microbatch, stage)] = start + cost
                slots[rank].append(Slot(action, rank, start, start + cost))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ConfigError("the schedule's per-rank orders wait on each other forever: "
                              + _describe_waits(per_rank, position, finished, num_chunks,
                                                placement))
    return slots


def _describe_waits(per_rank, position, finished, num_chunks, placement) -> str:
    pp = len(per_rank)
    waits = []
    for rank, actions in enumerate(per_rank):
        if position[rank] == len(actions):
            continue
        action = actions[position[rank]]
        stage = virtual_stage(rank, action.chunk, pp, placement)
        for kind, mb, dep_stage in dependencies(action, stage, pp * num_chunks):
            if (kind, mb, dep_stage) not in finished:
                owner, chunk = stage_owner(dep_stage, pp, placement)
                waits.append(f"rank {rank} at {action} needs {Action(kind, mb, chunk)} on "
                             f"rank {owner}")
                break
    return "; ".join(waits)


def peak_stored(actions: list[Action]) -> int:
    """Most microbatch-chunks whose forward ran and whose backward has not yet (for a split
    backward: whose ``W`` has not, since ``W`` needs the layer inputs): the activations a rank
    holds at its peak."""
    held = peak = 0
    for action in actions:
        held += activation_change(action)
        peak = max(peak, held)
    return peak


def activation_change(action: Action) -> int:
    """+1 when ``action`` starts holding a microbatch-chunk's activations, -1 when it lets them
    go, 0 for an ``I`` (its ``W`` still needs part of them)."""
    return {FORWARD: 1, BACKWARD: -1, BACKWARD_INPUT: 0, BACKWARD_WEIGHT: -1}[action.kind]


def bubble_fraction(slots: list[list[Slot]]) -> float:
    """Idle share of ``ranks x makespan``."""
    makespan = max((s.end for rank in slots for s in rank), default=0.0)
    if makespan == 0:
        return 0.0
    busy = sum(s.end - s.start for rank in slots for s in rank)
    return 1.0 - busy / (len(slots) * makespan)


def idle_in_span(slots: list[list[Slot]]) -> list[float]:
    """Per rank, the time it idles between its own first start and last end: the zero-bubble
    paper's accounting (iterations run back to back, so the ramp before a rank's first action
    and after its last overlaps the neighbouring iterations)."""
    return [(rank[-1].end - rank[0].start) - sum(s.end - s.start for s in rank) if rank else 0.0
            for rank in slots]
