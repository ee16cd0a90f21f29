"""Runs a pipeline schedule given as action lists: the one executor every schedule shares.

A schedule only decides the order (``schedule_actions``: one list of ``Action`` per pipeline
rank). This module turns the lists of *all* ranks into communication steps and executes this
rank's list: P2P, ``set_input_tensor``, ``schedule_utils.forward_step`` /
``schedule_utils.backward_step``, ``no_sync`` except on each chunk's last backward.

Split backward. An ``I`` is a backward run while a ``wgrad.WeightGradStore`` collects: layers
that can defer their weight gradients leave them there (the others compute theirs now), and the
input gradient goes to the previous stage as a ``B``'s would. The matching ``W`` runs the store.
The forward of a microbatch whose backward will be split runs under
``wgrad.expecting_split_backward``. Grad sync (:func:`sync_points`): a chunk's last ``B``/``I``
and its last ``B``/``W`` run outside ``no_sync`` where the gradients they finish are final, so a
data-parallel bucket holding a deferred weight is complete (and reduced, with
``--overlap-grad-reduce``) only after that weight's last ``W``.

Why it cannot deadlock. :func:`communication_plan` plays the lists on a clock of unit steps
(``schedule_plan.simulate`` with every action kind costing 1). An action at step ``t`` sends its
result in step ``t``'s batch, and the receiving neighbour posts the matching receive in *its*
batch for step ``t``; every rank posts its batches in step order, sends before it needs anything
new. A rank blocks only to complete an op of a batch at a step earlier than the action that needs
it, so by induction over steps every batch is eventually posted by both sides. Any lists that
``simulate`` can finish therefore run, whatever their order (1F1B, interleaved, GPipe, a third
party's); lists that cannot finish are rejected before anything runs. Under NCCL each batch is
one fused group whose peers post theirs at the same step, so pairing holds there too. Under gloo,
where a posted receive blocks nothing, receives are posted up to ``RECEIVE_LOOKAHEAD`` steps
early (still in step order, so each peer's messages match in the order it sends them): data then
arrives while the rank computes instead of when it asks.

Memory. A forward output is sent and the executor keeps only its autograd edge
(``torch.autograd.graph.get_gradient_edge``), so the activation itself is freed once the send
completes; backward then starts from that edge. A send is completed as soon as the peer is known
to hold its receive: a message from a peer sent at step ``t`` proves the peer posted all its
batches up to ``t``.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from dataclasses import dataclass, field

import torch
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import LOOPED
from plugtron.core.pipeline import steps as schedule_utils
from plugtron.core.pipeline.plan import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    INPUT_GRADIENT_KINDS,
    Action,
    actions_of_all_ranks,
    check_actions,
    forward_only_actions,
    simulate,
    stage_owner,
    virtual_stage,
)


@dataclass(frozen=True)
class Step:
    """What one rank does at one step: an action (or none), then one batch of P2P ops. Message
    keys are ``(kind, microbatch, virtual stage of the receiver)``."""

    tick: int
    action: Action | None = None
    send_next: bool = False
    send_prev: bool = False
    recv_prev: tuple | None = None  # activation for (F, mb, stage)
    recv_next: tuple | None = None  # output gradient for (B, mb, stage)


@dataclass
class ExecutionTrace:
    """What the last ``execute_actions`` call on this process did (one process is one rank)."""

    actions: list = field(default_factory=list)
    peak_stored: int = 0  # most microbatch-chunks held for backward at once
    compute_seconds: float = 0.0  # inside forward_step / backward_step and the W's
    wait_seconds: float = 0.0  # blocked on receives
    wall_seconds: float = 0.0  # the whole call
    #: compute seconds of each action by ``(kind, chunk)`` (kind ``F``, ``B``, ``I``, ``W``):
    #: the measured costs a simulation of the schedule takes (``plan.simulate``'s
    #: ``action_cost``, ``plugtron schedule show --costs``)
    action_seconds: dict = field(default_factory=dict)

    def record(self, action, seconds: float) -> None:
        self.compute_seconds += seconds
        self.action_seconds.setdefault((action.kind, action.chunk), []).append(seconds)

    @property
    def idle_fraction(self) -> float:
        """Share of the call this rank did not compute: the pipeline's bubble as the rank
        lived it (waits, communication, bookkeeping)."""
        return 1.0 - self.compute_seconds / self.wall_seconds if self.wall_seconds else 0.0


#: The trace of the most recent run on this process; tests and benchmarks read it.
last_trace = ExecutionTrace()

#: Steps ahead whose receives a rank posts early where receives block nothing (gloo). Each
#: holds one activation-sized buffer; posting them early lets data arrive during compute.
RECEIVE_LOOKAHEAD = 8


@functools.lru_cache(maxsize=64)
def communication_plan(per_rank: tuple, num_chunks: int, placement: str = LOOPED) -> tuple:
    """Per rank, its steps in order. ``per_rank`` is a tuple (per rank) of tuples of actions.

    A message goes to the rank that holds the receiving stage, in the direction of the ring
    that reaches it: ``next`` (rank + 1) or ``prev`` (rank - 1). Activations go ``next`` and
    gradients ``prev`` under the looped placement; under a V the second chunk's run the other
    way, and the hand-over between the two chunks of one rank is local (no message)."""
    pp = len(per_rank)
    stages = pp * num_chunks
    slots = simulate([list(a) for a in per_rank], num_chunks, 1.0, 1.0, 1.0, 1.0,
                     placement=placement)
    steps: list[dict[int, dict]] = [{} for _ in range(pp)]
    for rank, rank_slots in enumerate(slots):
        for slot in rank_slots:
            tick, a = int(slot.start), slot.action
            stage = virtual_stage(rank, a.chunk, pp, placement)
            steps[rank].setdefault(tick, {})["action"] = a
            if a.kind == FORWARD and stage < stages - 1:
                key, ahead = (FORWARD, a.microbatch, stage + 1), True
            elif a.kind in INPUT_GRADIENT_KINDS and stage > 0:
                key, ahead = (BACKWARD, a.microbatch, stage - 1), False
            else:
                continue
            receiver = stage_owner(key[2], pp, placement)[0]
            if receiver == rank:
                continue  # the next chunk of this rank: handed over locally
            forward_ring = receiver == (rank + 1) % pp if ahead else receiver != (rank - 1) % pp
            steps[rank][tick]["send_next" if forward_ring else "send_prev"] = True
            steps[receiver].setdefault(tick, {})[
                "recv_prev" if forward_ring else "recv_next"] = key
    return tuple(tuple(Step(tick, **fields) for tick, fields in sorted(rank_steps.items()))
                 for rank_steps in steps)


def plan_for(per_rank: list[list[Action]], num_chunks: int, num_microbatches: int,
             forward_only: bool, placement: str = LOOPED) -> tuple:
    """Check the lists and build the communication steps of every rank (cached: a schedule
    returns the same lists every iteration)."""
    return _checked_plan(tuple(tuple(a) for a in per_rank), num_chunks, num_microbatches,
                         forward_only, placement)


@functools.lru_cache(maxsize=64)
def _checked_plan(per_rank: tuple, num_chunks: int, num_microbatches: int,
                  forward_only: bool, placement: str) -> tuple:
    if forward_only:
        per_rank = tuple(tuple(forward_only_actions(actions)) for actions in per_rank)
    if len(per_rank) == 1 and num_chunks > 1:
        raise ConfigError("model chunks on a single pipeline stage need --pp > 1")
    check_actions([list(a) for a in per_rank], num_chunks, num_microbatches, forward_only)
    return communication_plan(per_rank, num_chunks, placement)


def execute_actions(per_rank: list[list[Action]], forward_step_func, data_iterator, model,
                    num_microbatches: int, forward_only: bool, parallel, p2p,
                    loss_scale: float = 1.0) -> list[dict]:
    """Run this rank's list of ``per_rank`` (the lists of all pipeline ranks, as
    ``schedule_actions`` returns them). Returns the loss reports of the last stage, in the order
    its forwards ran; other ranks return an empty list."""
    global last_trace
    chunks = list(model)
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    if len(iterators) == 1 and len(chunks) > 1:
        raise ConfigError("an interleaved schedule needs one data iterator per model chunk")
    if parallel.pp_size > 1 and p2p is None:
        raise ConfigError("a pipeline of more than one stage needs the run's P2P communicator")
    started = time.perf_counter()
    plan = plan_for(per_rank, len(chunks), num_microbatches, forward_only,
                    getattr(parallel, "pipeline_placement", LOOPED))
    runner = _Runner(chunks, iterators, forward_step_func, forward_only, parallel, p2p,
                     loss_scale)
    runner.prepare(plan[parallel.pp_rank])
    for index, step in enumerate(plan[parallel.pp_rank]):
        runner.step(index, step)
    # Only after success: on an error the peers are stuck too and waiting would hide it.
    runner.finish()
    runner.trace.wall_seconds = time.perf_counter() - started
    last_trace = runner.trace
    return runner.reports


def sync_points(actions: list[Action]) -> set[Action]:
    """The backward actions of one rank that run outside ``no_sync``: where a chunk's
    gradients of one kind are final. A ``B`` gives every parameter its gradient, an ``I`` those
    whose weight gradients do not wait (biases, layers that cannot defer), a ``W`` the deferred
    ones. So a chunk's last ``B``/``I`` syncs unless it is a ``B`` with a ``W`` after it, and its
    last ``B``/``W`` unless it is a ``B`` with an ``I`` after it (that ``B`` would mark final what
    the later action still adds to: schedules that mix whole and split backwards, DualPipeV).
    Data-parallel buckets not marked ready by then are reduced when the step finishes."""
    last_bi: dict[int, int] = {}
    last_bw: dict[int, int] = {}
    for index, a in enumerate(actions):
        if a.kind in INPUT_GRADIENT_KINDS:
            last_bi[a.chunk] = index
        if a.kind in (BACKWARD, BACKWARD_WEIGHT):
            last_bw[a.chunk] = index
    out = set()
    for chunk, index in last_bi.items():
        after = actions[index + 1:]
        if actions[index].kind == BACKWARD_INPUT or not any(
                a.kind == BACKWARD_WEIGHT and a.chunk == chunk for a in after):
            out.add(actions[index])
    for chunk, index in last_bw.items():
        after = actions[index + 1:]
        if actions[index].kind == BACKWARD_WEIGHT or not any(
                a.kind == BACKWARD_INPUT and a.chunk == chunk for a in after):
            out.add(actions[index])
    return out


class _Runner:
    """The state of one rank while it walks its steps."""

    def __init__(self, chunks, iterators, forward_step_func, forward_only, parallel, p2p,
                 loss_scale):
        self.chunks, self.iterators = chunks, iterators
        self.forward_step_func, self.forward_only = forward_step_func, forward_only
        self.pp, self.rank, self.p2p = parallel.pp_size, parallel.pp_rank, p2p
        self.placement = getattr(parallel, "pipeline_placement", LOOPED)
        self.stages = self.pp * len(chunks)
        self.loss_scale = loss_scale
        self.reports: list[dict] = []
        self.trace = ExecutionTrace()
        self.stored: dict[tuple, tuple] = {}  # (mb, chunk) -> (input, output or its edge)
        self.inbox: dict[tuple, tuple] = {}  # message key -> (tick, exchange, role)
        self.handed_over: dict[tuple, torch.Tensor] = {}  # message key -> tensor, same rank
        self.unacknowledged: list[tuple] = []  # (tick, peer, exchange, role) of sends
        self.output = None  # this step's result to send
        self.syncing: set[Action] = set()  # the actions that run outside no_sync
        self.split: set[tuple] = set()  # (mb, chunk) whose backward is I + W
        self.weight_grads: dict[tuple, wgrad.WeightGradStore] = {}  # (mb, chunk) -> its I's
        self.steps: tuple = ()
        self.receives_posted = 0  # steps whose receives are posted
        # Receives may run ahead of the step pairing where a posted receive blocks nothing
        # (gloo); under NCCL a batch is a stream-ordered group and must stay paired.
        self.lookahead = RECEIVE_LOOKAHEAD if p2p is not None and p2p.receives_run_ahead else 0

    def prepare(self, steps) -> None:
        self.steps = steps
        actions = [step.action for step in steps if step.action is not None]
        for a in actions:
            if a.kind == BACKWARD_INPUT and self.defers(a.chunk):
                self.split.add((a.microbatch, a.chunk))
        self.syncing = sync_points(actions)

    def defers(self, chunk: int) -> bool:
        """Whether the chunk's data-parallel wrapper lets weight gradients wait for ``W``
        (``DataParallelChunk.defers_weight_grads``)."""
        return bool(getattr(self.chunks[chunk], "defers_weight_grads", True))

    def post_receives(self, until: int) -> None:
        """Post the receives of steps up to ``until`` early, in step order: the data can then
        arrive while this rank computes. Each (peer, direction) still receives in the order the
        peer sends, so messages match."""
        for step in self.steps[self.receives_posted:until]:
            for role, key in (("recv_prev", step.recv_prev), ("recv_next", step.recv_next)):
                if key is not None:
                    exchange = self.p2p.exchange(**{role: True})
                    self.inbox[key] = (step.tick, exchange, role)
        self.receives_posted = max(self.receives_posted, until)

    def step(self, index: int, step: Step) -> None:
        if self.lookahead:
            self.post_receives(min(index + self.lookahead, len(self.steps)))
        if step.action is not None:
            self.trace.actions.append(step.action)
            if step.action.kind == FORWARD:
                self.forward(step.action)
            elif step.action.kind == BACKWARD_WEIGHT:
                self.weight(step.action)
            else:
                self.backward(step.action)
        if step.send_next or step.send_prev or step.recv_prev or step.recv_next:
            self.communicate(step)

    def stage_of(self, chunk: int) -> int:
        return virtual_stage(self.rank, chunk, self.pp, self.placement)

    def is_local(self, stage: int) -> bool:
        return stage_owner(stage, self.pp, self.placement)[0] == self.rank

    def receive(self, key: tuple) -> torch.Tensor:
        if key in self.handed_over:
            return self.handed_over.pop(key)
        tick, exchange, role = self.inbox.pop(key)
        start = time.perf_counter()
        exchange.wait(role)
        self.trace.wait_seconds += time.perf_counter() - start
        peer = self.p2p.prev_rank if role == "recv_prev" else self.p2p.next_rank
        self.acknowledge(peer, tick)
        return exchange.buffers.pop(role)

    def acknowledge(self, peer: int, tick: int) -> None:
        """``peer`` has posted its batches up to ``tick``: our sends to it until then finish."""
        keep = []
        for entry in self.unacknowledged:
            if entry[1] == peer and entry[0] <= tick:
                entry[2].wait(entry[3])
            else:
                keep.append(entry)
        self.unacknowledged = keep

    def forward(self, action: Action) -> None:
        chunk = action.chunk
        stage = self.stage_of(chunk)
        input_tensor = None
        if stage > 0:
            input_tensor = self.receive((FORWARD, action.microbatch, stage))
            input_tensor.requires_grad_(not self.forward_only)
        is_last = stage == self.stages - 1
        start = time.perf_counter()
        split = not self.forward_only and (action.microbatch, chunk) in self.split
        with wgrad.expecting_split_backward() if split else contextlib.nullcontext():
            output = schedule_utils.forward_step(self.forward_step_func, self.iterators[chunk],
                                                 self.chunks[chunk], input_tensor, is_last,
                                                 self.forward_only, self.reports)
        self.trace.record(action, time.perf_counter() - start)
        if not is_last and self.is_local(stage + 1):
            self.handed_over[(FORWARD, action.microbatch, stage + 1)] = output.detach()
        elif not is_last:
            self.output = output
        if self.forward_only:
            return
        kept: torch.Tensor | torch.autograd.graph.GradientEdge = output
        if not is_last and output.requires_grad:
            # Backward needs only the graph: keep its edge and let the activation go once sent.
            kept = torch.autograd.graph.get_gradient_edge(output)
        self.stored[(action.microbatch, chunk)] = (input_tensor, kept)
        self.trace.peak_stored = max(self.trace.peak_stored,
                                     len(self.stored) + len(self.weight_grads))

    def backward(self, action: Action) -> None:
        chunk = action.chunk
        stage = self.stage_of(chunk)
        input_tensor, output = self.stored.pop((action.microbatch, chunk))
        output_grad = None
        if stage < self.stages - 1:
            output_grad = self.receive((BACKWARD, action.microbatch, stage))
        start = time.perf_counter()
        # Grad sync (e.g. overlapped data-parallel reduction) only where it is complete.
        last = action in self.syncing
        store = wgrad.WeightGradStore()
        # A data-parallel wrapper that reduces inside backward's hooks cannot wait for a W:
        # then the I computes every gradient and the W finds nothing left.
        collect = (wgrad.collecting_weight_grads(store)
                   if (action.microbatch, chunk) in self.split else contextlib.nullcontext())
        with schedule_utils.sync_context(self.chunks[chunk], last), collect:
            if isinstance(output, torch.Tensor) and not output.requires_grad:
                input_grad = None  # nothing in this chunk depends on trainable values
            else:
                input_grad = schedule_utils.backward_step(output, output_grad, input_tensor,
                                                          self.loss_scale)
        if action.kind == BACKWARD_INPUT:
            self.weight_grads[(action.microbatch, chunk)] = store
        self.trace.record(action, time.perf_counter() - start)
        if stage > 0:
            grad = input_grad if input_grad is not None else torch.zeros_like(input_tensor)
            if self.is_local(stage - 1):
                self.handed_over[(BACKWARD, action.microbatch, stage - 1)] = grad
            else:
                self.output = grad

    def weight(self, action: Action) -> None:
        """The ``W`` of a split backward: the weight gradients its ``I`` left."""
        chunk = action.chunk
        store = self.weight_grads.pop((action.microbatch, chunk))
        start = time.perf_counter()
        last = action in self.syncing
        with schedule_utils.sync_context(self.chunks[chunk], last):
            store.run()
        self.trace.record(action, time.perf_counter() - start)

    def communicate(self, step: Step) -> None:
        output, self.output = self.output, None
        paired = not self.lookahead  # else the receives were posted ahead
        exchange = self.p2p.exchange(send_next=output if step.send_next else None,
                                     send_prev=output if step.send_prev else None,
                                     recv_prev=paired and step.recv_prev is not None,
                                     recv_next=paired and step.recv_next is not None)
        if step.send_next:
            self.unacknowledged.append((step.tick, self.p2p.next_rank, exchange, "send_next"))
        if step.send_prev:
            self.unacknowledged.append((step.tick, self.p2p.prev_rank, exchange, "send_prev"))
        if paired and step.recv_prev:
            self.inbox[step.recv_prev] = (step.tick, exchange, "recv_prev")
        if paired and step.recv_next:
            self.inbox[step.recv_next] = (step.tick, exchange, "recv_next")

    def finish(self) -> None:
        for _, _, exchange, role in self.unacknowledged:
            exchange.wait(role)
        self.unacknowledged = []
        for _, exchange, role in self.inbox.values():
            exchange.wait(role)
        self.inbox = {}


class ActionListSchedule:
    """Base class of a schedule plugin that is just an order: subclass it, implement the
    ``schedule_actions`` hook, and ``forward_backward`` executes exactly those lists."""

    @hookimpl
    def forward_backward(self, forward_step_func, data_iterator, model, num_microbatches,
                         forward_only, parallel, config, p2p, loss_scale):
        per_rank = actions_of_all_ranks(self.schedule_actions, parallel.pp_size, len(model),
                                        num_microbatches, config)
        return execute_actions(per_rank, forward_step_func, data_iterator, model,
                               num_microbatches, forward_only, parallel, p2p, loss_scale)


class ExecutorSchedule(ActionListSchedule):
    """The core's ``forward_backward`` for a schedule plugin that implements only
    ``schedule_actions`` (``forward_backward`` is optional): the run registers it last, so it
    answers only when the schedule itself does not. It reads the run's ``schedule_actions``
    hook through a weak reference: the plugin manager holds this object."""

    def __init__(self, pm):
        self._pm = weakref.ref(pm)

    def schedule_actions(self, **kwargs):
        return self._pm().hook.schedule_actions(**kwargs)


def ensure_forward_backward(pm) -> None:
    """Register :class:`ExecutorSchedule` unless a plugin of ``pm`` implements
    ``forward_backward`` (wrappers do not count)."""
    impls = pm.hook.forward_backward.get_hookimpls()
    if not any(not (impl.hookwrapper or impl.wrapper) for impl in impls):
        pm.register(ExecutorSchedule(pm), name="schedule:executor")
