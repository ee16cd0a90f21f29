"""Data-parallel wrapper of one model chunk (Megatron-Core's DistributedDataParallel).

Gradients accumulate into contiguous buffers (:mod:`plugtron.core.parallel.grad_buffer`), one per
(reduction group, param dtype, grad dtype): each parameter's ``main_grad`` is a view into its
buffer, fp32 under bf16/fp16 when ``--accumulate-allreduce-grads-in-fp32`` is on. A hook after
autograd accumulates ``param.grad`` adds it into ``main_grad`` and frees it.

The reduction is a plain SUM over the data-parallel (x context-parallel) group: the loss is a
token sum and ``grads.finalize_model_grads`` divides by the global token count afterwards, so
no 1/dp pre-scaling is needed (pre-scaling and then dividing by the token count would be wrong).
Expert parameters (``param.allreduce = False``) get buffers of their own, reduced over the expert
data-parallel group.

With ``--overlap-grad-reduce`` a bucket's reduction starts as soon as all its gradients are in
on the last microbatch (the schedule runs the others under :meth:`no_sync`); with it off, or for
whatever did not start, :meth:`finish_grad_sync` reduces. When the wrapper is built with
``sharded=True`` (the run's optimizer answered hook ``optimizer_shards_gradients`` with yes, like
``distributed-adam``), buckets are reduce-scattered and parameters are all-gathered after the
step by :meth:`start_param_sync`; with ``--overlap-param-gather`` the gather is waited for per
module, in the next forward.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.errors import PluginError
from plugtron.core.parallel.grad_buffer import (
    Bucket,
    GradBuffer,
    default_bucket_size,
    main_grad_of,
)
from plugtron.core.training.optimizer_shards import BucketShard, bucket_shard


class DistributedDataParallel(torch.nn.Module):
    #: Every rank holds whole parameters and gradients (``plugtron.api.DataParallelChunk``).
    grad_shard_groups: tuple = ((), ())
    #: Buckets wait for deferred weight gradients (``weight_grad_deferred``): W may run late.
    defers_weight_grads = True

    def __init__(self, module: torch.nn.Module, config, parallel, sharded: bool = False):
        super().__init__()
        self.module = module
        self.config = config
        self.parallel = parallel
        p = config.parallel
        self.overlap_grad_reduce = bool(p.overlap_grad_reduce)
        self.overlap_param_gather = bool(p.overlap_param_gather)
        self.sharded = sharded
        self._sync_enabled = True
        self.grad_buffers = self._build_buffers()
        for buffer in self.grad_buffers:
            for param in buffer.params:
                param.register_post_accumulate_grad_hook(self._grad_hook(buffer))
        # decided after the first forward (see below)
        self._uncovered_buckets: list[Bucket] | None = None
        self._modules_called: set[int] = set()
        if self.sharded and self.overlap_param_gather:
            self._register_gather_hooks()

    # ------------------------------------------------------------------ buffers and hooks

    def _build_buffers(self) -> list[GradBuffer]:
        par, p = self.parallel, self.config.parallel
        groups = {"dense": (par.dp_cp_group, len(par.dp_cp_ranks), par.dp_cp_rank),
                  "expert": (par.edp_group, len(par.edp_ranks), par.edp_rank)}
        bucket_size = p.ddp_bucket_size or default_bucket_size(len(par.dp_cp_ranks))
        by_key: dict[tuple, list] = {}
        # Reverse order: roughly the order in which backward produces the gradients.
        for param in reversed([q for q in self.module.parameters() if q.requires_grad]):
            kind = "dense" if getattr(param, "allreduce", True) else "expert"
            grad_dtype = torch.float32 if p.accumulate_allreduce_grads_in_fp32 else param.dtype
            by_key.setdefault((kind, param.dtype, grad_dtype), []).append(param)
        return [GradBuffer(params, grad_dtype, *groups[kind], bucket_size=bucket_size,
                           sharded=self.sharded)
                for (kind, _, grad_dtype), params in by_key.items()]

    def _grad_hook(self, buffer: GradBuffer):
        # The parameter holds its hook from C++, where the garbage collector cannot see it: a
        # hook that held the wrapper or the buffer (both hold the parameter) would keep the
        # whole model, its buffers and their process groups alive after the run, and every run
        # in a long-lived process (a notebook, a test pool's rank) would add a set of gloo
        # threads and sockets. So the hook reaches them through weak references.
        owner, weak_buffer = weakref.ref(self), weakref.ref(buffer)

        def hook(param: torch.nn.Parameter) -> None:
            grad, main_grad = param.grad, main_grad_of(param)
            # Same-dtype params accumulate straight into the buffer (``.grad`` is a view of
            # ``main_grad``, see zero_grad_buffer); others are added in and freed here.
            if grad is not None and grad.data_ptr() != main_grad.data_ptr():
                main_grad.add_(grad)
                param.grad = None
            if wgrad.weight_grad_deferred(param):
                return  # the rest of this gradient comes at the split backward's W
            ddp = owner()
            live_buffer = weak_buffer()
            if ddp is not None and live_buffer is not None and ddp._sync_enabled and \
                    ddp.overlap_grad_reduce:
                live_buffer.mark_ready(param)
        return hook

    # ------------------------------------------------------------------ the module API

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        getattr(self.module, "set_input_tensor")(tensor)  # the model chunk's pipeline entry

    @contextlib.contextmanager
    def no_sync(self):
        """Suppress grad sync for microbatches before the last one of the iteration."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Start (asynchronously) every bucket reduction not started yet."""
        for buffer in self.grad_buffers:
            buffer.launch_remaining()

    def finish_grad_sync(self) -> None:
        """Wait for the reductions in flight, starting first whatever has not started (all of
        them when overlap is off). Afterwards ``main_grad`` holds the sum over the group (sharded:
        only this rank's shard of each bucket does)."""
        for buffer in self.grad_buffers:
            buffer.finish_grad_reduction()

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by ``factor``: one operation per contiguous buffer."""
        for buffer in self.grad_buffers:
            buffer.grad_data.mul_(factor)

    def zero_grad_buffer(self) -> None:
        """Zero the buffers. Where a param has the buffer's dtype, its ``.grad`` becomes a view of
        ``main_grad``, so autograd accumulates in place: no per-microbatch copy (as torch DDP's
        ``gradient_as_bucket_view``)."""
        for buffer in self.grad_buffers:
            buffer.zero_grads()
            for param in buffer.params:
                main_grad = main_grad_of(param)
                param.grad = main_grad if main_grad.dtype == param.dtype else None
            buffer.reset()

    # ------------------------------------------------------------------ sharding optimizers

    def optimizer_shards(self) -> list[BucketShard]:
        """This rank's shard of every gradient bucket (:mod:`plugtron.core.training.optimizer_shards`):
        the public way for a sharding optimizer to reach gradients and parameters.

        The views stay valid for the wrapper's lifetime. The list has the same order on every
        rank of a bucket's group. Raises ``PluginError`` unless the buffers are sharded (the
        run's optimizer must answer hook ``optimizer_shards_gradients`` with ``True``).
        """
        if not self.sharded:
            raise PluginError("optimizer_shards() needs sharded gradient buffers: the optimizer "
                              "plugin must implement hook optimizer_shards_gradients and return "
                              "True")
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [bucket_shard(bucket, names)
                for buffer in self.grad_buffers for bucket in buffer.buckets]

    # ------------------------------------------------------------------ parameter gather

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Sharded buffers: all-gather every bucket's updated parameter shards. Waits unless
        ``--overlap-param-gather`` (then the next forward waits per module)."""
        if not self.sharded:
            return
        self._settle_coverage()
        for buffer in self.grad_buffers:
            for bucket in reversed(buffer.buckets):  # the forward needs the last bucket first
                bucket.start_param_gather()
        if force_sync or not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter gather in flight. Call it before reading parameters outside
        a forward pass (checkpoints, comparisons)."""
        for buffer in self.grad_buffers:
            for bucket in buffer.buckets:
                bucket.finish_param_gather()

    def _register_gather_hooks(self) -> None:
        bucket_of = {pid: b for buffer in self.grad_buffers
                     for pid, b in buffer.bucket_of.items()}
        for module in self.module.modules():
            buckets = {id(bucket_of[id(p)]): bucket_of[id(p)]
                       for p in module.parameters(recurse=False) if id(p) in bucket_of}
            if buckets:
                module.register_forward_pre_hook(self._gather_hook(list(buckets.values())))
        self.module.register_forward_pre_hook(self._root_gather_hook)

    def _gather_hook(self, buckets):
        def hook(module, args):
            if self._uncovered_buckets is None:
                self._modules_called.add(id(module))
            for bucket in buckets:
                bucket.finish_param_gather()
        return hook

    def _root_gather_hook(self, module, args):
        # Parameters read by a module whose forward never runs (e.g. an output weight read by
        # its parent) are waited for here, at the start of the chunk's forward.
        for bucket in self._uncovered_buckets or ():
            bucket.finish_param_gather()

    def _settle_coverage(self) -> None:
        """After the first forward (no gather is ever pending during it), the buckets holding
        parameters of modules that were not called must be waited for up front."""
        if self._uncovered_buckets is not None or not self.overlap_param_gather:
            return
        called: set[int] = set()
        for module in self.module.modules():
            if id(module) in self._modules_called:
                called.update(id(p) for p in module.parameters(recurse=False))
        uncovered = {}
        for buffer in self.grad_buffers:
            for param in buffer.params:
                if id(param) not in called:
                    bucket = buffer.bucket_of[id(param)]
                    uncovered[id(bucket)] = bucket
        self._uncovered_buckets = list(uncovered.values())

    # ------------------------------------------------------------------ state

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.load_state_dict(*args, **kwargs)
