"""The two ways an optimizer's state is sharded over data parallelism: element ranges of the
gradient buckets (ZeRO-1, for element-wise optimizers such as Adam) and whole parameters per
rank (layer-wise, for optimizers that need whole tensors, such as Muon: :class:`LayerWiseOptimizer`
at the end of this module).

What a ZeRO-1 optimizer sees of the data-parallel wrapper: this rank's shard of each bucket.

When the run's optimizer answers hook ``optimizer_shards_gradients`` with yes,
:class:`~plugtron.core.parallel.ddp.DistributedDataParallel` pads every gradient bucket so that the
data-parallel ranks own equal, contiguous shards of it (shards ignore parameter boundaries), and
after ``finish_grad_sync`` rank ``r`` holds the summed gradient of its shard only. Parameters
live in a flat buffer laid out the same way. ``DistributedDataParallel.optimizer_shards()``
describes that layout with the dataclasses below, which is all a ZeRO-1 optimizer needs: it
steps the elements of its shards, writes them into :attr:`ParamShard.data`, and calls the
wrapper's ``start_param_sync()`` so that every rank gets them. No plugin reads the wrapper's
buffers or buckets, so their layout can change without breaking one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from plugtron.core.errors import PluginError
from plugtron.core.parallel import comm
from plugtron.core.parallel.grad_buffer import Bucket
from plugtron.core.parallel.sharding import is_dtensor, is_expert
from plugtron.core.training import grads as grad_utils
from plugtron.core.training.optimizer import OPTIMIZER_STATE_KEY, TorchOptimizer, named_params


@dataclass(frozen=True)
class ParamShard:
    """The elements of one parameter that fall in this rank's shard of one bucket."""

    #: The model parameter.
    param: torch.nn.Parameter
    #: Its module-qualified name (as ``plugtron.core.training.optimizer.named_params`` gives it).
    name: str
    #: ``[lo, hi)`` of these elements in the flattened parameter, ``param.reshape(-1)``.
    param_range: tuple[int, int]
    #: ``[lo, hi)`` of the same elements in the bucket shard, ``[0, BucketShard.shard_size)``.
    shard_range: tuple[int, int]
    #: 1-D view of the reduced gradient of these elements (the buffer's grad dtype). It holds
    #: the sum over the data-parallel group after ``finish_grad_sync()``.
    grad: torch.Tensor
    #: 1-D view of the parameter's storage for these elements (the model's dtype): writing it
    #: writes the parameter on this rank; ``start_param_sync()`` sends it to the other ranks.
    data: torch.Tensor


@dataclass(frozen=True)
class BucketParam:
    """One parameter of a bucket, whole, where it sits in the bucket."""

    param: torch.nn.Parameter
    name: str
    #: ``[lo, hi)`` of the flattened parameter in the bucket, ``[0, group size x shard_size)``.
    bucket_range: tuple[int, int]


@dataclass(frozen=True)
class BucketShard:
    """This rank's shard of one gradient bucket.

    Every rank of :attr:`group` gets its buckets in the same order, so an optimizer may run a
    collective per bucket (e.g. all-gather its state at checkpoint time: the shards of ranks
    ``0..n-1`` concatenated are the bucket, in which :attr:`params` say where each parameter is).
    """

    #: The process group the bucket is sharded over (data parallel x context parallel, or the
    #: expert data-parallel group for expert parameters).
    group: torch.distributed.ProcessGroup | None
    #: Elements per shard; the bucket is ``group size x shard_size`` elements, padding included.
    shard_size: int
    #: dtype of the model parameters in the bucket.
    param_dtype: torch.dtype
    device: torch.device
    #: Every parameter of the bucket, in bucket order.
    params: tuple[BucketParam, ...]
    #: The parts of those parameters in this rank's shard, in bucket order (empty when the shard
    #: is all padding).
    shards: tuple[ParamShard, ...]


def bucket_shard(bucket: Bucket, names: dict[int, str]) -> BucketShard:
    """Describe this rank's shard of ``bucket``; ``names`` maps ``id(param)`` to its name."""
    buffer = bucket.buffer
    if buffer.param_data is None:
        raise ValueError("a sharded optimizer needs the buffer's parameter copy (the "
                         "distributed optimizer's grad buffers keep one)")
    shard_lo, shard_hi = bucket.shard_range()
    params, shards = [], []
    for param in bucket.params:
        p_lo, p_hi = buffer.ranges[id(param)]
        name = names[id(param)]
        params.append(BucketParam(param, name, (p_lo - bucket.start, p_hi - bucket.start)))
        lo, hi = max(p_lo, shard_lo), min(p_hi, shard_hi)
        if lo < hi:
            shards.append(ParamShard(param, name, (lo - p_lo, hi - p_lo),
                                     (lo - shard_lo, hi - shard_lo),
                                     buffer.grad_data[lo:hi], buffer.param_data[lo:hi]))
    return BucketShard(buffer.group, bucket.shard_size, buffer.param_dtype, bucket.grad.device,
                       tuple(params), tuple(shards))


# --------------------------------------------------------------------------- layer-wise


def owners_by_size(sizes: list[int], ranks: int) -> list[int]:
    """The owning rank (``0..ranks-1``) of each tensor of ``sizes`` elements: the largest
    first, each to the rank that owns the fewest elements so far (ties: the lower rank), so
    the ranks' totals differ by at most the largest tensor. The same answer on every rank."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return owner


@dataclass(frozen=True)
class OwnedParams:
    """Parameters replicated over one group (dp x cp for dense parameters, the expert
    data-parallel group for expert ones) and the rank of the group that steps each."""

    group: torch.distributed.ProcessGroup | None
    #: ``(name, param, owner)`` in ``named_params`` order (the same on every rank of the group).
    params: tuple[tuple[str, torch.nn.Parameter, int], ...]

    @property
    def rank(self) -> int:
        return comm.group_rank(self.group)

    @property
    def size(self) -> int:
        return comm.group_size(self.group)


def layer_wise_owners(named, parallel) -> list[OwnedParams]:
    """``named`` (``named_params``' pairs) split into whole parameters per data-parallel rank,
    balanced by size: dense ones over dp x cp, expert ones over expert data parallelism."""
    return [OwnedParams(group, params) for group, _, params in _owned(
        named, ((False, parallel.dp_cp_group, comm.group_size(parallel.dp_cp_group)),
                (True, parallel.edp_group, comm.group_size(parallel.edp_group))))]


def _owned(named, groups) -> list:
    """``(group, size, ((name, param, owner), ...))`` for each of ``groups`` (``(expert, group,
    size)``) that has parameters: the split of :func:`layer_wise_owners`, which the estimate
    makes too, from sizes alone."""
    out = []
    for expert, group, size in groups:
        members = [(n, p) for n, p in named if is_expert(p) == expert]
        if members:
            owners = owners_by_size([p.numel() for _, p in members], size)
            out.append((group, size,
                        tuple((n, p, o) for (n, p), o in zip(members, owners))))
    return out


def layer_wise_memory(named, state_bytes: Callable, dp_cp: int, edp: int) -> tuple[int, int]:
    """What :class:`LayerWiseOptimizer` holds on its fullest rank, for ``plugtron estimate``:
    ``(state, gather)``. ``named``: a rank position's trainable ``(name, param)`` pairs in
    ``named_params`` order (meta tensors do); ``state_bytes(name, param)``: the optimizer's
    bytes for one parameter on the rank that steps it (the fp32 main copy included where there
    is one). ``state`` is the fullest rank's sum over the parameters it owns (the dense and the
    expert group's fullest ranks added: they may be one process); ``gather`` the
    largest pair of buffers :meth:`LayerWiseOptimizer.share_params` fills at once after a step
    (this rank's parameters padded to the fullest rank's, and the group's all-gather of them)."""
    state = gather = 0
    for _, size, params in _owned(named, ((False, None, dp_cp), (True, None, edp))):
        per_rank = [0] * size
        for name, param, owner in params:
            per_rank[owner] += state_bytes(name, param)
        state += max(per_rank)
        if size == 1:
            continue
        for dtype in {p.dtype for _, p, _ in params}:
            width = max(sum(p.numel() for _, p, o in params if o == r and p.dtype == dtype)
                        for r in range(size))
            gather = max(gather, width * (size + 1) * dtype.itemsize)
    return state, gather


class LayerWiseOptimizer(TorchOptimizer):
    """A torch optimizer that steps whole parameters, each on one data-parallel rank, and
    shares them after the step (Megatron-Core's layer-wise distributed optimizer): for an
    optimizer that needs whole tensors (Muon orthogonalizes matrices), with its state and fp32
    main parameters split about 1/dp, where ZeRO-1 would cut parameters into element ranges.

    Built like :class:`TorchOptimizer` (``make_inner``, ``groups_for``). The data-parallel
    wrapper all-reduces gradients whole, so every rank computes the global norm over all of them
    (the single process's) and clips; each steps the parameters it owns
    (:func:`layer_wise_owners`), then :meth:`share_params` all-gathers the others from their
    owners. Checkpoint state is gathered from the owners at save time: every rank returns every
    parameter's state, so a checkpoint resumes under any layout, dp size or optimizer sharding.
    """

    def __init__(self, model_chunks, config, parallel, make_inner, groups_for=None):
        self.every_param = named_params(model_chunks)
        if any(is_dtensor(p) for _, p in self.every_param):
            raise PluginError("the layer-wise optimizer steps whole parameters, but the "
                              "data-parallel wrapper shards them (fsdp2): use ddp")
        self.owned = layer_wise_owners(self.every_param, parallel)
        super().__init__(model_chunks, config, parallel, make_inner, groups_for)

    def stepped_params(self, named):
        mine = {id(p) for owned in self.owned for _, p, o in owned.params if o == owned.rank}
        return [(n, p) for n, p in named if id(p) in mine]

    def zero_grad(self) -> None:
        for _, p in self.every_param:
            p.grad = None
        super().zero_grad()

    def prepare_main_grads(self):
        """Main gradients for the parameters this rank steps; every gradient for the norm."""
        mains = {id(m): main for m, main in zip(self.model_params, self.main_params)}
        pairs = []
        for _, param in self.every_param:
            g = grad_utils.grad_of(param)
            g = (torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                 if g is None else g.float())
            main = mains.get(id(param))
            if main is not None:
                main.grad = g
            pairs.append((g, param))
        return pairs

    def publish_main_params(self) -> None:
        super().publish_main_params()  # this rank's main parameters into its model's
        self.share_params()

    @torch.no_grad()
    def share_params(self) -> None:
        """Every parameter from the rank that stepped it to all ranks of its group (one
        all-gather per group and dtype)."""
        for owned in self.owned:
            for dtype in sorted({p.dtype for _, p, _ in owned.params}, key=str):
                items = [(o, p.shape, p) for _, p, o in owned.params if p.dtype == dtype]
                _all_gather_owned(owned, items, dtype, lambda p: p.detach(),
                                  lambda p, value: p.copy_(value))

    def sharded_state_dict(self) -> dict:
        """Every parameter's state, gathered from its owner (a collective over each group)."""
        own = super().sharded_state_dict()
        state: dict = {OPTIMIZER_STATE_KEY: own.pop(OPTIMIZER_STATE_KEY)}
        for owned in self.owned:
            keys = {n: sorted(own[n]) for n, _, o in owned.params if o == owned.rank}
            if owned.size > 1:  # which state each owner keeps (none before a first step)
                every: list = [None] * owned.size
                torch.distributed.all_gather_object(every, keys, group=owned.group)
                keys = {n: k for part in every for n, k in part.items()}
            for name, _, o in owned.params:
                state[name] = dict(own[name]) if o == owned.rank else {}
            items = [(o, p.shape, (n, k)) for n, p, o in owned.params for k in keys.get(n, ())]
            _all_gather_owned(owned, items, torch.float32, lambda item: own[item[0]][item[1]],
                              lambda item, value: state[item[0]].__setitem__(item[1],
                                                                             value.clone()))
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        super().load_sharded_state_dict(state)  # the parameters this rank steps
        stepped = set(self.names)
        with torch.no_grad():  # the others: the fp32 master weights beat a bf16 model's
            for name, param in self.every_param:
                saved = state.get(name, {}).get("main_param")
                if name not in stepped and saved is not None:
                    param.copy_(saved.view(param.shape))


def _all_gather_owned(owned: OwnedParams, items: list, dtype: torch.dtype,
                      read: Callable, write: Callable) -> None:
    """``items`` are ``(owner, shape, item)`` in one order on every rank: this rank's are
    ``read(item)``, flattened into one buffer padded to the largest rank's, all-gathered over
    the group; ``write(item, value)`` receives each item another rank owns."""
    if owned.size == 1 or not items:
        return
    numel = [math.prod(shape) for _, shape, _ in items]
    width = max(sum(n for n, (o, _, _) in zip(numel, items) if o == r)
                for r in range(owned.size))
    if width == 0:
        return
    device = owned.params[0][1].device
    local = torch.zeros(width, dtype=dtype, device=device)
    offset = 0
    for n, (o, _, item) in zip(numel, items):
        if o == owned.rank:
            local[offset:offset + n] = read(item).reshape(-1)
            offset += n
    gathered = comm.all_gather_tensor(local, owned.group)
    starts = [r * width for r in range(owned.size)]
    for n, (o, shape, item) in zip(numel, items):
        if o != owned.rank:
            write(item, gathered[starts[o]:starts[o] + n].view(shape))
        starts[o] += n
