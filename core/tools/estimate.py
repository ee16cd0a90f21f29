"""Memory per rank of a run, before it starts (``plugtron estimate``, train's header, the check
that refuses a run which cannot fit).

Nothing is launched and no weight is allocated: every distinct rank position (pipeline stage,
tp rank, expert rank) builds its model chunks on the meta device with the model plugin's own
``model_provider``, so parameter counts are those of the built model. Each chunk then says what
one microbatch keeps for backward (``activation_bytes``, core/contracts/activations.py); the selected
schedule's own action lists (core/pipeline/plan.py) say how many microbatch-chunks each stage
holds at its peak. Optimizer plugins say how many fp32 values they keep per element of each
parameter (hook ``optimizer_state_per_param``, default 2: Adam's moments; Muon keeps 1 for its
matrices and AdamW's 2 for the rest) and whether they shard them (hooks
``optimizer_shards_gradients``, element ranges, and ``optimizer_shards_layer_wise``, whole
parameters per rank: counted with the optimizer's own split, plus its all-gather buffers).

Counted per rank: parameters (model dtype), gradient buffers (fp32 under
``--accumulate-allreduce-grads-in-fp32`` with bf16/fp16, else the model dtype), optimizer state
(plus an fp32 master copy under bf16/fp16), activations in flight, the rebuilt activations of a
recomputed group, backward's live transient (:data:`BACKWARD_TRANSIENT_FRACTION`) and, on CPU,
the heap's slack (:data:`CPU_HEAP_SLACK_FRACTION`), both measured on CPU
(docs/performance.md). Not counted: the
runtime itself (CUDA context, torch's own libraries), data loader buffers, communication buffers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from plugtron.core.config import derive_padded_vocab_size, num_microbatches
from plugtron.core.contracts.activations import (
    ActivationShape,
    ChunkActivations,
    module_activation_bytes,
)
from plugtron.core.contracts.data_parallel import DataParallelMemory
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.pipeline.executor import RECEIVE_LOOKAHEAD, communication_plan
from plugtron.core.pipeline.p2p import activation_shape as p2p_shape
from plugtron.core.pipeline.plan import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    actions_of_all_ranks,
    activation_change,
)
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import (
    data_parallel_memory,
    optimizer_state_per_param,
    shards_layer_wise,
    wants_sharded_gradients,
)
from plugtron.core.plugins.objects import PluginObject, call_declared
from plugtron.core.plugins.options import with_plugin_sections
from plugtron.core.plugins.selection import resolve_data_parallel, resolve_schedule, selected_driver
from plugtron.core.plugins.tokenizers import build_tokenizer
from plugtron.core.training.builder import build_model, model_plugins_of
from plugtron.core.training.optimizer import named_params
from plugtron.core.training.optimizer_shards import layer_wise_memory
from plugtron.core.training.validate import apply_schedule_placement

GIB = 2**30

#: Backward's live transient: gradients of the activations of the microbatch being run
#: backward and autograd's temporaries, as a share of tp x the largest microbatch-chunk's
#: activations (about the microbatch's activations before the tp split: the transient did not
#: shrink with tp). Measured as live tensor bytes (torch.profiler's memory events) on CPU over
#: every pipeline schedule: 0.06-0.2 (benchmarks/bench_pipeline_schedules.py). It is what a
#: GPU's allocator counts as allocated; not measured on GPUs.
BACKWARD_TRANSIENT_FRACTION = 0.15
#: On CPU only, in the same unit: freed activation memory glibc keeps resident, which the
#: resident set shows (a CPU run is limited by it) and live tensors do not. With the transient,
#: measured 0.44-0.56 at 1 rank and dp 2, 0.39-0.61 at tp 2 (tests/core/tools/test_memory_estimate.py,
#: default model, several runs).
CPU_HEAP_SLACK_FRACTION = 0.35


@dataclass
class RankEstimate:
    """Bytes on one rank position (every rank in ``ranks`` holds the same)."""

    ranks: list
    pp_rank: int
    tp_rank: int
    ep_rank: int
    parameters: int  # count
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # replicated optimizer
    optimizer_bytes_distributed: int  # state sharded over dp x cp
    activations_per_microbatch: list  # bytes per chunk, one microbatch
    in_flight: int  # microbatch-chunks held at the peak
    activation_bytes: int  # held at the peak
    recompute_bytes: int
    workspace_bytes: int  # backward's live transient and the pipeline's receive buffers
    distributed_optimizer: bool
    #: The run's optimizer state as its data-parallel wrapper counts it (hook
    #: ``data_parallel_memory``): one of the two columns above under ddp.
    optimizer_selected: int = 0
    #: Parameters and gradients a sharding wrapper gathers for compute at the peak; with a
    #: layer-wise sharded optimizer, the buffers it all-gathers the stepped parameters into.
    gathered_bytes: int = 0
    #: CPU only: freed memory the heap keeps resident (:data:`CPU_HEAP_SLACK_FRACTION`).
    heap_slack_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_selected + self.gathered_bytes

    @property
    def total(self) -> int:
        return (self.state_bytes + self.activation_bytes + self.recompute_bytes
                + self.workspace_bytes + self.heap_slack_bytes)

    @property
    def transient_bytes(self) -> int:
        """Recompute, backward workspace and (CPU) heap slack: what the tables print as one."""
        return self.recompute_bytes + self.workspace_bytes + self.heap_slack_bytes


@dataclass
class MemoryEstimate:
    world_size: int
    ranks: list = field(default_factory=list)  # RankEstimate per distinct position
    schedule: str = ""
    microbatches: int = 1
    notes: list = field(default_factory=list)

    @property
    def peak(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.total)

    def header_line(self) -> str:
        return header_line(self)

    def table(self) -> str:
        return format_table(self)


def _dtype_bytes(config) -> int:
    return 2 if (config.training.bf16 or config.training.fp16) else 4


def _dtype_name(config) -> str:
    return "bf16" if config.training.bf16 else "fp16" if config.training.fp16 else "fp32"


def _finalized(config, world_size: int):
    """A copy with the plugins' sections and the padded vocabulary (which the dataset fixes in
    a run: here the tokenizer it would use)."""

    config = with_plugin_sections(copy.deepcopy(config))
    apply_schedule_placement(config)
    m = config.model
    if m.vocab_size is None:
        m.vocab_size = _dataset_vocab_size(config)
    derive_padded_vocab_size(config, config.parallel.tensor_model_parallel_size)
    return config


def _dataset_vocab_size(config) -> int:
    """The vocabulary the selected dataset says it reads (hook ``dataset_vocab_size``), or its
    tokenizer's (``--tokenizer-type``; contract 2's ``default_tokenizer`` attribute)."""
    name = selected_driver(config, "dataset")
    dataset = registry.instantiate(registry.load("dataset", name))
    size = call_declared(PluginObject("dataset", name, "?", dataset), "dataset_vocab_size",
                         config=config)
    if size is not None:
        return int(size)
    tokenizer = config.data.tokenizer_type or getattr(dataset, "default_tokenizer", None)
    if tokenizer is None:
        raise ConfigError(f"data {name!r} does not fix the vocabulary before reading it: give "
                          f"--vocab-size or --tokenizer-type for the estimate")
    return build_tokenizer(tokenizer, config.data.tokenizer_model, None).vocab_size


def _contexts(config, world_size: int) -> dict:
    """One ParallelContext per distinct rank position, with the ranks that share it."""

    p = config.parallel
    out: dict = {}
    for rank in range(world_size):
        ctx = ParallelContext.build(
            world_size, rank, tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size, vp=p.virtual_pipeline_model_parallel_size,
            cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
            etp=p.expert_tensor_parallel_size, create_groups=False,
            placement=p.pipeline_placement)
        key = (ctx.pp_rank, ctx.tp_rank, ctx.ep_rank, ctx.etp_rank)
        out.setdefault(key, [ctx, []])[1].append(rank)
    return out


@contextlib.contextmanager
def _no_random_init():
    """torch's random initialisers on meta tensors go through its reference implementations,
    whose first use imports the compiler (seconds); a meta tensor has no values to draw."""

    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "trunc_normal_", "orthogonal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _meta_chunks(config, parallel, plugins) -> list:
    """The rank's model chunks on the meta device (shapes, no storage)."""

    dtype = {2: torch.bfloat16 if config.training.bf16 else torch.float16}.get(
        _dtype_bytes(config), torch.float32)
    with torch.device("meta"), _no_random_init():
        return [chunk.to(dtype=dtype) for chunk in build_model(config, parallel,
                                                               plugins=plugins)]


def activation_shape(config, cuda: bool) -> ActivationShape:
    p, m = config.parallel, config.model
    e = _dtype_bytes(config)
    return ActivationShape(
        micro_batch_size=config.training.micro_batch_size,
        seq_length=m.seq_length // p.context_parallel_size, context_length=m.seq_length,
        tp=p.tensor_model_parallel_size,
        sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
        dtype_bytes=e, mask_bytes=1 if cuda else e, cuda=cuda, dtype=_dtype_name(config))


def _chunk_activations(chunk, shape) -> tuple[ChunkActivations, bool]:
    """What the chunk says, or (when it does not define ``activation_bytes``) the sum of its
    layers that do, flagged as incomplete."""
    own = getattr(chunk, "activation_bytes", None)
    if callable(own):
        value = own(shape)
        return (value if isinstance(value, ChunkActivations) else ChunkActivations(int(value)),
                True)
    return ChunkActivations(module_activation_bytes(chunk, shape)), False


def _held_peak(actions, chunks: list) -> tuple[int, int]:
    """(peak bytes, microbatch-chunks held then) over one rank's schedule. ``chunks``: the
    ``ChunkActivations`` of each chunk. A forward adds what the microbatch keeps; a whole
    backward lets it go; a split backward's ``I`` trades the stored activations for what its
    ``W`` will need (holding the larger of the two at its peak), and the ``W`` lets that go."""
    held = peak = count = peak_count = 0
    for action in actions:
        chunk = chunks[action.chunk]
        if action.kind == BACKWARD_INPUT:
            # the backward frees the stored activations layer by layer while it builds what
            # W keeps: at most the larger of the two at once, then what W keeps
            during = held - chunk.stored + max(chunk.stored, chunk.until_weights)
            if during > peak:
                peak, peak_count = during, count
            held += chunk.until_weights - chunk.stored
        elif action.kind == BACKWARD_WEIGHT:
            held -= chunk.until_weights
        else:
            held += activation_change(action) * chunk.stored
        count += activation_change(action)
        if held > peak:
            peak, peak_count = held, count
    return peak, peak_count


def _p2p_buffers(per_rank: list, num_chunks: int, placement: str, cuda: bool) -> list[int]:
    """Per rank, the most activation-sized receive buffers posted at once: under gloo the
    executor posts the receives of the next ``RECEIVE_LOOKAHEAD`` steps early; under NCCL
    those of one step."""
    plan = communication_plan(tuple(tuple(a) for a in per_rank), num_chunks, placement)
    window = 1 if cuda else RECEIVE_LOOKAHEAD
    out = []
    for steps in plan:
        receives = [(s.recv_prev is not None) + (s.recv_next is not None) for s in steps]
        out.append(max((sum(receives[i:i + window]) for i in range(len(receives))),
                       default=0))
    return out


def estimate_memory(config, world_size: int, cuda: bool | None = None) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of ``config`` on ``world_size`` ranks (``cuda``: default,
    whether this machine has a GPU)."""

    if cuda is None:
        cuda = torch.cuda.is_available()
    config = _finalized(config, world_size)
    p = config.parallel
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    dp = max(1, world_size // (tp * pp * cp))
    microbatches = max(1, num_microbatches(config, dp))
    plugins = model_plugins_of(config)
    schedule_name = resolve_schedule(config)
    schedule = registry.instantiate(registry.load("schedule", schedule_name))
    chunks_per_rank = p.virtual_pipeline_model_parallel_size or 1
    actions = actions_of_all_ranks(schedule.schedule_actions, pp, chunks_per_rank,
                                   microbatches, config)
    wrapper = resolve_data_parallel(config)
    declared_state = optimizer_state_per_param(config)
    distributed = wants_sharded_gradients(config)
    # whole parameters per data-parallel rank: the state is split, the gradients are not
    layer_wise = not distributed and shards_layer_wise(config)
    e = _dtype_bytes(config)
    mixed = e == 2
    grad_e = 4 if (mixed and p.accumulate_allreduce_grads_in_fp32) else e
    shape = activation_shape(config, cuda)
    result = MemoryEstimate(world_size, schedule=schedule_name, microbatches=microbatches)
    message = math.prod(p2p_shape(config, SimpleNamespace(cp_size=cp, tp_size=tp))) * e
    buffers = (_p2p_buffers(actions, chunks_per_rank, p.pipeline_placement, cuda)
               if pp > 1 else [0])
    if declared_state is None:
        result.notes.append(f"optimizer {selected_driver(config, 'optimizer')!r} does not implement "
                            f"optimizer_state_per_param: counted as 2 fp32 values per "
                            f"parameter (Adam)")
    main_copy = 4 if mixed else 0  # the fp32 main parameter beside bf16/fp16 weights
    for (pp_rank, tp_rank, ep_rank, _), (ctx, ranks) in sorted(_contexts(config,
                                                                         world_size).items()):
        chunks = _meta_chunks(config, ctx, plugins)
        numel = sum(param.numel() for chunk in chunks for param in chunk.parameters())
        # A frozen parameter (a model transform's) is a weight only: no gradient, no state.
        trainable = sum(param.numel() for chunk in chunks for param in chunk.parameters()
                        if param.requires_grad)
        per_chunk, complete = zip(*(_chunk_activations(chunk, shape) for chunk in chunks))
        if not all(complete) and not any("activation_bytes" in n for n in result.notes):
            result.notes.append(f"model {selected_driver(config, 'model')!r} defines no activation_bytes: "
                                f"only its layers that do are counted")
        stored = [c.stored for c in per_chunk]
        held, in_flight = _held_peak(actions[pp_rank], list(per_chunk))
        named = named_params(chunks)
        values = {id(param): 2 if declared_state is None else declared_state(name, param)
                  for name, param in named}

        def param_bytes(name, param):
            return param.numel() * (4 * values[id(param)] + main_copy)

        optimizer = sum(param_bytes(name, param) for name, param in named)
        counted = data_parallel_memory(config, chunks=chunks, dp_cp=dp * cp,
                                       edp=ctx.edp_size,
                                       state_per_param=max(values.values(), default=0),
                                       state_values=lambda param: values.get(id(param), 0),
                                       shard_gradients=distributed)
        if counted is None:  # the wrapper does not count itself: whole tensors, as ddp
            counted = DataParallelMemory(numel * e, trainable * grad_e, -(-optimizer // (dp * cp))
                                         if distributed else optimizer)
            note = (f"data-parallel wrapper {wrapper!r} does not implement "
                    f"data_parallel_memory: counted as whole parameters and gradients (ddp)")
        else:
            note = counted.note
        if note and note not in result.notes:
            result.notes.append(note)
        if layer_wise:  # the wrapper counted whole tensors; the optimizer keeps its own
            state, gather = layer_wise_memory(named, param_bytes, dp * cp, ctx.edp_size)
            counted = dataclasses.replace(counted, optimizer_bytes=state,
                                          gathered_bytes=counted.gathered_bytes + gather)
            note = (f"optimizer {selected_driver(config, 'optimizer')!r} shards its state "
                    f"layer-wise: whole parameters per dp x cp rank, the fullest rank "
                    f"counted; gathered: its all-gather of the stepped parameters")
            if note not in result.notes:
                result.notes.append(note)
        result.ranks.append(RankEstimate(
            ranks=ranks, pp_rank=pp_rank, tp_rank=tp_rank, ep_rank=ep_rank, parameters=numel,
            param_bytes=counted.param_bytes, grad_bytes=counted.grad_bytes,
            optimizer_bytes=optimizer, optimizer_selected=counted.optimizer_bytes,
            gathered_bytes=counted.gathered_bytes,
            optimizer_bytes_distributed=-(-optimizer // (dp * cp)),
            activations_per_microbatch=stored, in_flight=in_flight, activation_bytes=held,
            recompute_bytes=max(c.recompute_peak for c in per_chunk),
            workspace_bytes=(int(BACKWARD_TRANSIENT_FRACTION * tp * max(stored))
                             + buffers[pp_rank] * message),
            heap_slack_bytes=0 if cuda else int(CPU_HEAP_SLACK_FRACTION * tp * max(stored)),
            distributed_optimizer=distributed))
    return result


# --------------------------------------------------------------------------- available memory


def available_memory_per_rank(ranks_on_node: int, cuda: bool | None = None) -> float:
    """CUDA: one device's memory. CPU: the host's memory shared by the node's ranks."""

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return float(torch.cuda.get_device_properties(0).total_memory)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(host) / max(1, ranks_on_node)


def check_fits(estimate: MemoryEstimate, ranks_on_node: int, cuda: bool | None = None) -> None:
    """ConfigError (exit 2) naming the numbers when the largest rank cannot fit."""
    have = available_memory_per_rank(ranks_on_node, cuda)
    worst = estimate.peak
    if worst.total <= have:
        return
    where = "device" if (cuda if cuda is not None else _has_cuda()) else \
        f"host memory / {ranks_on_node} ranks"
    raise ConfigError(
        f"this run needs about {worst.total / GIB:,.2f} GiB per rank at its largest (rank "
        f"{worst.ranks[0]}: pp stage {worst.pp_rank}, tp rank {worst.tp_rank}): "
        f"{worst.param_bytes / GIB:,.2f} GiB parameters, {worst.grad_bytes / GIB:,.2f} GiB "
        f"gradients, {worst.optimizer_selected / GIB:,.2f} GiB optimizer state, "
        f"{worst.activation_bytes / GIB:,.2f} GiB activations ({worst.in_flight} "
        f"microbatch-chunks in flight), {worst.transient_bytes / GIB:,.2f}"
        f" GiB recompute and backward workspace; a rank has {have / GIB:,.2f} GiB ({where}). "
        f"Reduce --micro-batch-size, --seq-length, --hidden-size or --num-layers, use "
        f"--recompute-granularity, --sequence-parallel, --use-distributed-optimizer or more "
        f"tp/pp, or pass --no-memory-check to launch anyway (details: plugtron estimate)")


def _has_cuda() -> bool:

    return torch.cuda.is_available()


# --------------------------------------------------------------------------- report


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def format_table(estimate: MemoryEstimate) -> str:
    """The per-rank table ``plugtron estimate`` prints (MiB)."""
    head = ("ranks", "pp", "tp", "ep", "params", "weights", "grads", "optim", "optim(dist)",
            "gathered", "act/mb", "in flight", "activations", "recompute+ws", "total")
    rows = []
    for r in estimate.ranks:
        ranks = ",".join(map(str, r.ranks[:4])) + ("..." if len(r.ranks) > 4 else "")
        rows.append((ranks, str(r.pp_rank), str(r.tp_rank), str(r.ep_rank),
                     f"{r.parameters:,}", _mib(r.param_bytes), _mib(r.grad_bytes),
                     _mib(r.optimizer_bytes), _mib(r.optimizer_bytes_distributed),
                     _mib(r.gathered_bytes),
                     "/".join(_mib(a) for a in r.activations_per_microbatch),
                     str(r.in_flight), _mib(r.activation_bytes),
                     _mib(r.transient_bytes), _mib(r.total)))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def header_line(estimate: MemoryEstimate) -> str:
    """One line for train's console header: the largest rank's total and its parts."""
    r = estimate.peak
    return (f"memory estimate (rank {r.ranks[0]}, largest): {_mib(r.total)} MiB = weights "
            f"{_mib(r.param_bytes)} + grads {_mib(r.grad_bytes)} + optimizer "
            f"{_mib(r.optimizer_selected)}"
            + (f" + gathered {_mib(r.gathered_bytes)}" if r.gathered_bytes else "")
            + f" + activations {_mib(r.activation_bytes)} "
            f"({r.in_flight} in flight) + recompute/workspace "
            f"{_mib(r.transient_bytes)}")
