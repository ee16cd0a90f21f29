"""Layer backend ``local``: Megatron-style tensor-parallel layers in plain torch.

The vocabulary-parallel pieces (embedding, output logits, cross entropy) are the interface's
defaults from core, shared with other backends.

Communication goes through the autograd-aware collectives of the public API (``plugtron.api``),
so the same code runs on one process (every collective is the identity) and on any tp group, on
CPU with gloo or on GPUs with nccl. Every weight is drawn full by its init method and this rank
keeps its shard (``plugtron.api.shard_of``), so a tp shard is exactly the slice of
what tp 1 initialises with the same seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import (
    ConfigError,
    LayerBackend,
    affine,
    block_sizes,
    context_parallel_attention,
    copy_to_tensor_parallel_region,
    cpu_matrix_support,
    current_forward_context,
    deferred_layer_norm,
    document_runs,
    gather_from_tensor_parallel_region,
    linear,
    mark_sequence_parallel,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    sequence_parallel_linear,
    set_tensor_parallel,
    shard_of,
    split_backward_expected,
)

from . import cpu_attention, document_attention
from .attention_mask import attention_mask


class _TPLayer(torch.nn.Module):
    """A layer that knows this rank's tp group (read from the run's ParallelContext)."""

    def __init__(self, parallel, sequence_parallel: bool):
        super().__init__()
        self._parallel = parallel
        self.sequence_parallel = sequence_parallel

    @property
    def tp_group(self):
        return self._parallel.tp_group

    @property
    def tp_rank(self) -> int:
        return self._parallel.tp_rank

    @property
    def tp_size(self) -> int:
        return self._parallel.tp_size


class ColumnParallelLinear(_TPLayer):
    """``Y = X A + b`` with A's output dimension split over tp.

    Input: replicated ``[b, s, in]`` (sequence-sharded under SP, gathered here). Output: this
    rank's ``out / tp`` features, or all of them with ``gather_output``. With
    ``partition_chunks`` c the output is c blocks ([gate; up]) split separately, so the local
    output is [gate_r; up_r] and a gathered output is put back in [gate; up] order; a tuple of
    block sizes ([z, x, B, C, dt]) does the same for blocks of different sizes.
    """

    def __init__(self, input_size, output_size, *, bias, init_method, parallel,
                 sequence_parallel=False, gather_output=False, skip_bias_add=False,
                 partition_chunks=1):
        super().__init__(parallel, sequence_parallel)
        tp = self.tp_size
        try:
            blocks = block_sizes(output_size, partition_chunks)
        except ValueError as exc:
            raise ConfigError(f"column-parallel output size {output_size}: {exc}") from None
        if any(block % tp for block in blocks):
            raise ConfigError(f"column-parallel output size {output_size} is not divisible by "
                              f"tp {tp} in each of its blocks {blocks}")
        full = init_method((output_size, input_size))
        self.weight = torch.nn.Parameter(shard_of(full, 0, self.tp_rank, tp, partition_chunks))
        set_tensor_parallel(self.weight, 0, partition_chunks)
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size // tp))
            set_tensor_parallel(self.bias, 0, partition_chunks)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.partition_chunks = partition_chunks

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:
            out = sequence_parallel_linear(x, self.weight, bias, self.tp_group)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
            out = linear(x, self.weight, bias)
        if self.gather_output:
            out = gather_from_tensor_parallel_region(out, self.tp_group,
                                                         chunks=self.partition_chunks)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_TPLayer):
    """``Y = X A + b`` with A's input dimension split over tp; partial outputs are summed over
    tp (all-reduce), or reduce-scattered along the sequence under SP. The bias is replicated and
    added after the reduction (under SP it sees only this rank's tokens: marked
    ``sequence_parallel`` so its gradient is summed over tp)."""

    def __init__(self, input_size, output_size, *, bias, init_method, parallel,
                 sequence_parallel=False, input_is_parallel=True, skip_bias_add=False):
        super().__init__(parallel, sequence_parallel)
        if input_size % self.tp_size:
            raise ConfigError(f"row-parallel input size {input_size} is not divisible by "
                              f"tp {self.tp_size}")
        if sequence_parallel and not input_is_parallel:
            raise ConfigError("a row-parallel linear under --sequence-parallel needs its input "
                              "already split over tp (input_is_parallel=True)")
        full = init_method((output_size, input_size))
        self.weight = torch.nn.Parameter(shard_of(full, 1, self.tp_rank, self.tp_size))
        set_tensor_parallel(self.weight, 1)
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        if self.tp_size == 1 and self.bias is not None and not self.skip_bias_add:
            # Nothing to reduce: the bias goes into the matmul (addmm), not a pass of its own.
            return linear(x, self.weight, self.bias), None
        out = linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        else:
            out = reduce_from_tensor_parallel_region(out, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias
        return out + self.bias, None


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        if split_backward_expected():  # the scale's gradient waits for W
            return affine(F.rms_norm(x, (x.shape[-1],), None, self.eps), self.weight)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose scale's gradient a split backward defers to ``W``."""

    def forward(self, x):
        if split_backward_expected() and self.weight is not None and len(
                self.normalized_shape) == 1:
            return deferred_layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)


class CoreAttention(torch.nn.Module):
    """Causal scaled-dot-product attention over this rank's heads; key/value groups are
    repeated for GQA. Packed samples (``document_ids`` of the forward context, from
    ``--reset-attention-mask``) attend within their document through an explicit mask; without
    them the ``is_causal`` fast path runs. Attention dropout draws from the model-parallel stream (``dropout_rng``):
    each tp rank holds different heads. Under context parallelism the keys of other cp ranks
    are reached by the core's ``context_parallel_attention`` (``--cp-comm-type``).
    ``window_size`` ``(left, 0)``: sliding-window attention (refused with cp > 1 before
    launch)."""

    def __init__(self, num_heads, num_query_groups, head_dim, dropout, dropout_rng,
                 parallel=None, cp_comm_type="p2p", window_size=None):
        super().__init__()
        self.num_heads, self.num_query_groups = num_heads, num_query_groups
        self.dropout = dropout
        self._dropout_rng = dropout_rng
        self._parallel, self.cp_comm_type = parallel, cp_comm_type
        self.window_size = window_size

    def kernel_dtype_bytes(self, shape) -> int:
        """Bytes of an element of the q, k, v and output that attention keeps for backward
        (``plugtron estimate``): 4 where :func:`_training_attention` computes a half dtype in
        fp32 (a CPU without AMX for it), else the activations' own."""
        half = _HALF_DTYPES.get(shape.dtype)
        return 4 if not shape.cuda and half is not None and _fp32_on_cpu(half) \
            else shape.dtype_bytes

    def forward(self, q, k, v):
        p = self.dropout if self.training else 0.0
        context = current_forward_context()
        inference = context.inference
        if inference is not None:  # generation: new queries over cached keys, padding hidden
            mask = inference.attention_mask(q.shape[1], k.shape[1])
            window = attention_mask(q.shape[1], k.shape[1], window=self.window_size,
                                    device=mask.device)
            if window is not None:  # left padding shifts whole rows: index distance = distance
                mask = mask & window
            return _masked_attention(q, k, v, mask, self.num_query_groups != self.num_heads)
        document_ids = context.document_ids
        if self._parallel is not None and self._parallel.cp_size > 1:
            with self._dropout_rng():  # the whole sequence's document numbers (not cp-split)
                return context_parallel_attention(q, k, v, self._parallel, self.cp_comm_type, p,
                                                  document_ids)
        b, s = q.shape[0], q.shape[1]
        runs = None
        if document_ids is not None and self.window_size is None:
            runs = document_runs(document_ids)
            if document_attention.applies_with_dropout(q, p):
                with self._dropout_rng():
                    out = document_attention.per_document_dropout_attention(
                        *(t.transpose(1, 2) for t in (q, k, v)), runs, p)
                return out.transpose(1, 2).reshape(b, s, -1)
            if not document_attention.applies(q.transpose(1, 2), p, runs):
                runs = None  # one masked kernel
        mask = None if runs is not None else attention_mask(
            s, k.shape[1], window=self.window_size, device=q.device,
            document_ids=None if document_ids is None else document_ids.to(q.device))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        v_dim = v.shape[-1]
        if v_dim < q.shape[-1]:
            # Values narrower than queries and keys (multi-latent attention): torch's fused
            # kernels want one head dim, else it builds the whole score matrix. Zero channels
            # give zero outputs, sliced off; the gradient of the padding is dropped.
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - v_dim))
        if runs is not None:  # each document alone: less work than the masked kernel
            if q.dtype != torch.float32 and _fp32_on_cpu(q.dtype):  # as _training_attention
                out = document_attention.per_document_attention(
                    q.float(), k.float(), v.float(), runs).to(q.dtype)
            else:
                out = document_attention.per_document_attention(q, k, v, runs)
            return out[..., :v_dim].transpose(1, 2).reshape(b, s, -1)
        with self._dropout_rng():
            out = _training_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                      dropout_p=p,
                                      enable_gqa=self.num_query_groups != self.num_heads)
        return out[..., :v_dim].transpose(1, 2).reshape(b, s, -1)


_HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fp32_on_cpu(half: torch.dtype) -> bool:
    """Whether training attention in ``half`` runs in fp32 on this CPU (no AMX for it)."""
    return cpu_matrix_support(half) != "amx"


def _training_attention(q, k, v, **kwargs):
    """SDPA; on CPU in half precision without AMX for the dtype it runs in fp32 and casts back.
    Without native bf16/fp16 matrix instructions, torch's CPU flash-attention backward in half
    precision is 4-5x slower than in fp32 (130 vs 28 ms forward and backward at [8, 4, 256, 64],
    AVX2); with AVX512-FP16 alone fp16 is still slower (12.6 vs 9.0 ms); with AMX-BF16, bf16 is
    the faster (8.4 ms, forward 0.9 vs 2.9) and the casts would only cost. fp32 is also the more
    exact of the two. The price is fp32 copies of q, k and v held for backward. With AMX, causal
    bf16 attention (packed documents and sliding windows included) keeps the flash forward but
    takes the matmul backward of cpu_attention.py (6 ms instead of 8-9 forward and backward)."""
    if q.device.type == "cpu" and q.dtype in _HALF_DTYPES.values() \
            and torch.is_grad_enabled() and q.requires_grad:
        if _fp32_on_cpu(q.dtype):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
            return out.to(q.dtype)
        if cpu_attention.applies(q, k, v, **kwargs):
            return cpu_attention.causal_attention(q, k, v, kwargs.get("scale"),
                                                  kwargs.get("attn_mask"))
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _masked_attention(q, k, v, mask, gqa: bool):
    b, s = q.shape[0], q.shape[1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(b, s, -1)


class LocalBackend(LayerBackend):
    name = "local"
    supports_context_parallel = True  # core_attention reaches the other cp ranks
    supports_document_ids = True  # core_attention masks packed documents (attention_mask.py)
    builds_anywhere = True  # plain torch: meta, CPU and GPU

    def column_parallel_linear(self, input_size, output_size, *, bias, init_method,
                               gather_output=False, skip_bias_add=False, partition_chunks=1):
        return ColumnParallelLinear(input_size, output_size, bias=bias, init_method=init_method,
                                    parallel=self.parallel,
                                    sequence_parallel=self.sequence_parallel,
                                    gather_output=gather_output, skip_bias_add=skip_bias_add,
                                    partition_chunks=partition_chunks)

    def row_parallel_linear(self, input_size, output_size, *, bias, init_method,
                            input_is_parallel=True, skip_bias_add=False):
        return RowParallelLinear(input_size, output_size, bias=bias, init_method=init_method,
                                 parallel=self.parallel,
                                 sequence_parallel=self.sequence_parallel,
                                 input_is_parallel=input_is_parallel,
                                 skip_bias_add=skip_bias_add)

    def norm(self, hidden_size):
        model = self.config.model
        if model.normalization == "RMSNorm":
            module = RMSNorm(hidden_size, model.norm_epsilon)
        else:
            module = LayerNorm(hidden_size, eps=model.norm_epsilon)
        if self.sequence_parallel:
            mark_sequence_parallel(module)
        return module

    def core_attention(self, num_heads, num_query_groups, head_dim, dropout, window_size=None):
        """``window_size`` ``(left, 0)``: sliding-window attention (``--window-size``); an
        extension of the interface this backend alone offers (validation refuses it on
        others)."""
        return CoreAttention(num_heads, num_query_groups, head_dim, dropout, self.dropout_rng,
                             self.parallel, self.config.parallel.cp_comm_type, window_size)
