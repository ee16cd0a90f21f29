"""Data-parallel wrapper ``fsdp2`` (``--use-torch-fsdp2``, ``--data-parallel-sharding-strategy
optim_grads_params``): torch's ``fully_shard`` over dp x cp.

Parameters, gradients and optimizer state are sharded (DTensors, dim 0) over the data-parallel
group; expert parameters over the expert data-parallel group. Units: every layer held in a
``ModuleList``/``ModuleDict`` (decoder layers, MTP layers), every outermost expert-only module
(a layer's experts) on the expert group, and the chunk itself (embedding, final
norm, output layer: the root, whose parameters torch keeps gathered from forward to backward).
Tensor-parallel pieces are sharded again over dp (2-D), each pipeline chunk is its own root.

Mixed precision follows Megatron's: fp32 master shards, compute in bf16/fp16
(``MixedPrecisionPolicy.param_dtype``), gradients reduced in fp32 under
``--accumulate-allreduce-grads-in-fp32`` (the default). Reductions are sums (the core divides by
the token count). Every microbatch's backward reduce-scatters into the sharded gradient, so
gradients stay at 1/dp, and parameters are gathered again for each forward and backward;
``--torch-fsdp2-no-reshard-after-forward`` keeps the parameters gathered and accumulates the
gradients whole for the whole step instead (one gather and one reduce-scatter per step).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from plugtron.api import (
    ConfigError,
    ConfigSection,
    DataParallelMemory,
    PluginError,
    hookimpl,
    local_tensor,
    model_dtype,
    opt,
    optimizer_takes_dtensor_params,
    selected_drivers,
    wants_sharded_gradients,
)

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # a torch without FSDP2: refused before launch (plugtron_validate)
    fully_shard = None  # type: ignore[assignment]  # the optional import's absence


class AllReduceScatter:
    """A reduce-scatter done as an in-place all-reduce of FSDP's scratch input plus a copy of
    this rank's slice. On gloo its all-reduce is more than twice as fast as its reduce-scatter
    (3.7 against 8.3 ms for 3.2 MB at 2 ranks on this machine's 2 cores), which made fsdp2's
    per-microbatch reductions its largest cost on CPU. The sums are the same numbers.

    Given to ``FSDPModule.set_custom_reduce_scatter``, which calls ``allocate`` and the object
    (torch's ``ReduceScatter`` interface, not importable from a public module)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        torch.distributed.all_reduce(input_tensor, op=op, group=group)
        rank = torch.distributed.get_rank(group)
        output_tensor.copy_(input_tensor.view(-1, output_tensor.numel())[rank])
        return None


def _is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def wrapping_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules wrapped as their own unit, deepest first (the chunk itself not included):
    each element of a ``ModuleList``/``ModuleDict`` (decoder and MTP layers), and each outermost
    expert-only module (a layer's experts: one unit, since a grouped matmul reads every
    expert's weights at once).

    A unit's parameters are gathered during its own forward only, so a module must not read
    another unit's parameters (docs/data_parallel.md)."""
    units = []

    def visit(parent: torch.nn.Module) -> None:
        for child in parent.children():
            params = list(child.parameters())
            if not params:
                continue
            if all(_is_expert(p) for p in params):
                units.append(child)
                continue
            visit(child)
            if isinstance(parent, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                units.append(child)

    visit(module)
    return units


def _shard_numel(params: list, dp_cp: int, edp: int) -> int:
    """Elements of ``params`` one rank holds: dense ones over dp x cp, expert ones over edp."""
    dense = sum(q.numel() for q in params if not _is_expert(q))
    expert = sum(q.numel() for q in params if _is_expert(q))
    return -(-dense // dp_cp) + -(-expert // edp)


def _own_params(unit: torch.nn.Module, inner: set[int]) -> list:
    """Parameters of ``unit`` not managed by a unit inside it."""
    out, seen = [], set()
    for p in unit.parameters():
        if id(p) not in inner and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class FSDP2Chunk(torch.nn.Module):
    """One model chunk under ``fully_shard`` (``plugtron.api.DataParallelChunk``)."""

    sharded = False  # no flat buffers for a ZeRO-1 optimizer: the parameters are the shards
    #: Gradients are reduce-scattered by hooks inside backward, so a W could not add to them.
    defers_weight_grads = False

    def __init__(self, module: torch.nn.Module, config, parallel):
        super().__init__()
        p = config.parallel
        device = torch.device(parallel.device).type
        dense_mesh = DeviceMesh.from_group(parallel.dp_cp_group, device)
        expert_mesh = DeviceMesh.from_group(parallel.edp_group, device)
        compute = model_dtype(config)
        mixed = compute != torch.float32
        policy = MixedPrecisionPolicy(
            param_dtype=compute if mixed else None,
            reduce_dtype=torch.float32 if mixed and p.accumulate_allreduce_grads_in_fp32
            else None,
            # The model casts its own activations, as under ddp (rotary tables and router
            # logits stay fp32 where the model keeps them so).
            cast_forward_inputs=False)
        self.reshard_after_forward = bool(config.fsdp2.torch_fsdp2_reshard_after_forward)
        # The layers' sharding declarations (tensor-parallel dim, expert, sequence parallel,
        # shared group) live on the parameter objects, which fully_shard replaces.
        declared = {name: dict(vars(param)) for name, param in module.named_parameters()}
        with torch.no_grad():  # buffers (rotary tables, ...) compute in the training dtype
            for buffer in module.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(compute)
            if mixed:  # fp32 masters start from the rounded weights, as Megatron's (and ddp's)
                for param in module.parameters():
                    param.data = param.data.to(compute).float()
        managed: set[int] = set()
        units = wrapping_units(module)
        for unit in units:
            params = _own_params(unit, managed)
            if not params:
                continue
            kinds = {_is_expert(q) for q in params}
            if len(kinds) > 1:
                raise PluginError(f"fsdp2: {type(unit).__qualname__} holds expert and dense "
                                  f"parameters directly; expert parameters must sit in "
                                  f"modules of their own to be sharded over the expert group")
            # The last layer's backward comes right after its forward: resharding it in
            # between would only gather it again (torchtitan does the same).
            reshard = self.reshard_after_forward and unit is not units[-1]
            fully_shard(unit, mesh=expert_mesh if kinds == {True} else dense_mesh,
                        reshard_after_forward=reshard, mp_policy=policy)
            managed.update(id(q) for q in unit.parameters())
        if any(_is_expert(q) for q in _own_params(module, managed)):
            raise PluginError("fsdp2: the chunk holds expert parameters outside an expert-only "
                              "module")
        fully_shard(module, mesh=dense_mesh, reshard_after_forward=self.reshard_after_forward,
                    mp_policy=policy)
        for name, param in module.named_parameters():
            param.__dict__.update(declared.get(name, {}))
        self.module = module
        self.fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        # Prefetch: each layer starts gathering the next one's parameters before its own
        # forward runs (torch prefetches backward by itself), as torchtitan sets it.
        layers = [u for u in units if isinstance(u, FSDPModule)
                  and not all(_is_expert(q) for q in u.parameters())]
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])
        # NCCL's reduce-scatter is the fast one; gloo's is not (AllReduceScatter).
        slow_reduce_scatter = (hasattr(FSDPModule, "set_custom_reduce_scatter") and
                               torch.distributed.get_backend(parallel.dp_cp_group) == "gloo")
        for m in self.fsdp_modules:
            # SUM, not mean (the core divides by the token count); gloo has no pre-scaled sum.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            # MoE ranks may leave an expert without tokens: reduce zeros, keep ranks in step.
            m.set_reduce_scatter_unused_params(True, recurse=False)
            if slow_reduce_scatter:
                # torch's ReduceScatter base class is private (fsdp._fully_shard._fsdp_api);
                # AllReduceScatter has its allocate and __call__
                m.set_custom_reduce_scatter(AllReduceScatter())  # type: ignore[arg-type]
        self.grad_shard_groups = ((parallel.dp_cp_group,), (parallel.edp_group,))

    # ------------------------------------------------------------------ the module API

    def forward(self, *args, **kwargs):
        with warnings.catch_warnings():
            # torch warns when a root returns a view (GPT's logits do), in case the caller
            # changes it in place; the schedules and loss functions compute out of place.
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        getattr(self.module, "set_input_tensor")(tensor)  # the model chunk's pipeline entry

    @contextlib.contextmanager
    def no_sync(self):
        """Microbatches before a chunk's last. Resharding after forward (the default), each
        still reduce-scatters into the sharded gradient, so gradients stay at 1/dp. With
        ``--torch-fsdp2-no-reshard-after-forward`` the parameters stay gathered and the
        gradients accumulate whole until the last microbatch: one gather and one reduce-scatter
        per step, at the memory of whole parameters and gradients during the step."""
        if self.reshard_after_forward:
            yield
            return
        self._set_syncing(False)
        try:
            yield
        finally:
            self._set_syncing(True)

    def _set_syncing(self, sync: bool) -> None:
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(sync, recurse=False)
            m.set_reshard_after_backward(sync, recurse=False)
            m.set_is_last_backward(sync)

    def start_grad_sync(self) -> None:
        """Reductions start inside backward, unit by unit."""

    def finish_grad_sync(self) -> None:
        """torch waits for the reduce-scatters at the end of each backward."""

    def scale_grads(self, factor: float) -> None:
        grads = [local_tensor(q.grad) for q in self.module.parameters() if q.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def zero_grad_buffer(self) -> None:
        self._reshard()
        for q in self.module.parameters():
            q.grad = None

    def start_param_sync(self, force_sync: bool = False) -> None:
        """The optimizer stepped the shards: drop any gathered copy, the next forward gathers
        the new values."""
        self._reshard()

    def finish_param_sync(self) -> None:
        """Nothing in flight: the shards are the parameters."""

    def _reshard(self) -> None:
        for m in self.fsdp_modules:
            m.reshard()


@dataclass
class FSDP2Options:
    torch_fsdp2_reshard_after_forward: bool = opt(
        True, "--torch-fsdp2-reshard-after-forward",
        "Free each layer's gathered parameters after its forward (gather again for "
        "backward); off keeps them gathered for the whole step.", is_flag=True,
        negative="--torch-fsdp2-no-reshard-after-forward")


class FSDP2:
    @hookimpl
    def plugtron_config_sections(self):
        # before contract 3 the field was config.parallel.torch_fsdp2_reshard_after_forward
        return [ConfigSection("fsdp2", FSDP2Options, title="fsdp2", formerly=("parallel",))]

    @hookimpl
    def plugtron_validate(self, config, world_size):
        p = config.parallel
        if world_size == 1:
            raise ConfigError("--use-torch-fsdp2 on one rank shards nothing (and needs a process "
                              "group): use the ddp wrapper, or launch several ranks "
                              "(--nproc-per-node)")
        if fully_shard is None:
            raise ConfigError(f"--use-torch-fsdp2 needs torch.distributed.fsdp.fully_shard, "
                              f"which torch {torch.__version__} lacks: install torch >= 2.6 or "
                              f"use the ddp wrapper (drop --use-torch-fsdp2)")
        if wants_sharded_gradients(config):
            raise ConfigError("--use-torch-fsdp2 already shards the optimizer state over dp: "
                              "--use-distributed-optimizer (distributed-adam) is redundant; drop "
                              "it (fsdp2 runs --optimizer adam over the shards)")
        if p.overlap_param_gather:
            raise ConfigError("--overlap-param-gather belongs to the distributed optimizer; "
                              "fsdp2 gathers each layer's parameters itself, prefetching the "
                              "next: drop it")
        name = selected_drivers(config)["optimizer"]
        if not optimizer_takes_dtensor_params(config):
            raise ConfigError(f"--use-torch-fsdp2: optimizer {name!r} does not say it can step "
                              f"DTensor parameters (hook optimizer_takes_dtensor_params); use "
                              f"adam or sgd, or the ddp wrapper")

    @hookimpl
    def wrap_model_chunk(self, config, module, parallel, shard_gradients):
        return FSDP2Chunk(module, config, parallel)

    @hookimpl
    def data_parallel_memory(self, config, chunks, dp_cp, edp, state_values, shard_gradients):
        compute = model_dtype(config).itemsize
        mixed = compute == 2
        reduce_e = 4 if (not mixed or config.parallel.accumulate_allreduce_grads_in_fp32) \
            else compute
        t = config.training
        dp = max(1, dp_cp // config.parallel.context_parallel_size)
        microbatches = max(1, t.global_batch_size // (t.micro_batch_size * dp))
        shard = trainable_shard = state_shard = 0
        gathered = 0
        for chunk in chunks:
            params = list(chunk.parameters())
            shard += _shard_numel(params, dp_cp, edp)
            # frozen parameters (a model transform's) have no gradient and no optimizer state
            trainable = [q for q in params if q.requires_grad]
            trainable_shard += _shard_numel(trainable, dp_cp, edp)
            # fp32 state values: each parameter's, over its shard (its elements split alike)
            state_shard += sum(_shard_numel([q], dp_cp, edp) * state_values(q)
                               for q in trainable)
            managed: set[int] = set()
            units = []
            for unit in wrapping_units(chunk):
                own = _own_params(unit, managed)
                managed.update(id(q) for q in unit.parameters())
                units.append(sum(q.numel() for q in own))
            root = sum(q.numel() for q in _own_params(chunk, managed))
            largest = max(units, default=0)
            if config.fsdp2.torch_fsdp2_reshard_after_forward:
                # The root stays gathered; one unit computes while the next is prefetched, and
                # backward holds one unit's whole gradient and its reduce-scatter copy.
                units_in_flight = (root + 2 * largest) * compute + 2 * largest * reduce_e
            elif microbatches > 1:  # the whole chunk gathered, gradients accumulated whole
                units_in_flight = (root + sum(units)) * (compute + reduce_e)
            else:  # the whole chunk gathered, gradients reduce-scattered unit by unit
                units_in_flight = (root + sum(units)) * compute + 2 * largest * reduce_e
            gathered = max(gathered, units_in_flight)
        return DataParallelMemory(
            param_bytes=shard * 4, grad_bytes=trainable_shard * reduce_e,
            optimizer_bytes=state_shard * 4, gathered_bytes=gathered,
            note="fsdp2: parameters, gradients and optimizer state sharded over dp x cp "
                 "(experts over the expert data-parallel group), plus the gathered units")
