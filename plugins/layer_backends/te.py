"""Layer backend ``te``: the layer-backend interface over transformer_engine.pytorch.

transformer-engine is imported only when this backend is selected (``--layer-backend te``), so
machines without it are unaffected. Selecting it without CUDA is a ConfigError; without
transformer-engine a PluginError that says what to install.

Design choice: TE computes (fused GEMMs, fused norms, fused attention) but plugtron's own
collectives (core/parallel/tensor_parallel.py) do the tensor- and sequence-parallel communication. TE's
built-in sequence parallelism splits dimension 0 of sequence-first ``[s, b, h]`` activations,
while plugtron's activations are batch-first ``[b, s, h]``; keeping TE's modules local
(``parallel_mode=None``) keeps one set of communication semantics for every backend.
Consequently TE's communication/GEMM overlap is not used.

Parameter names are the same as under ``local`` (``linear_qkv.weight``, ``linear_proj.bias``,
``input_layernorm.weight``, ...): the linear layers and core attention are subclasses of TE's
``Linear`` and ``DotProductAttention`` (no wrapper level in the name), with a row-parallel bias
kept as TE's own ``bias`` (returned by TE, added after the reduction); the norms are TE's
``LayerNorm`` (``weight``, ``bias``) and ``RMSNorm`` (``weight``) as they are. TE's fused
norm + linear (``LayerNormLinear``, whose norm is ``layer_norm_weight``) is not used, so the
norm keeps its own module and Megatron-Core's local-spec name.

Packed documents (the forward context's ``document_ids``): TE's attention takes them as Megatron
does, in its THD format: the batch's tokens laid end to end, ``cu_seqlens`` at each document's
start, mask type ``padding_causal``. Under cp, plugtron's cp attention keeps them apart (TE's own
THD cp wants each document's chunks in another order than plugtron's cp split gives).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from plugtron.api import (
    ConfigError,
    LayerBackend,
    ParallelContext,
    PluginError,
    context_parallel_attention,
    copy_to_tensor_parallel_region,
    current_forward_context,
    document_runs,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    mark_sequence_parallel,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    set_tensor_parallel,
    shard_of,
)

from .te_wgrad import DelayedWeightGrads, cannot_delay_reason

#: plugtron's --cp-comm-type values in TE's spelling
_TE_CP_COMM_TYPES = {"p2p": "p2p", "allgather": "all_gather", "a2a": "a2a"}

INSTALL_HINT = ("pip install 'transformer-engine[pytorch]' (or plugtron[te]) on a machine with "
                "CUDA, or use --layer-backend local")


def import_transformer_engine():
    """``transformer_engine.pytorch``, or a clear error saying what is missing."""
    have_te = importlib.util.find_spec("transformer_engine") is not None
    have_cuda = torch.cuda.is_available()
    if not have_te:
        cuda_note = "" if have_cuda else "; it also needs a CUDA GPU, and none is visible"
        raise PluginError(f"layer backend 'te' needs transformer-engine, which is not "
                          f"installed{cuda_note}: {INSTALL_HINT}")
    if not have_cuda:
        raise ConfigError("layer backend 'te' needs a CUDA GPU (transformer-engine runs on "
                          "NVIDIA GPUs only) and none is visible: use --layer-backend local")
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415 - optional backend: needs CUDA
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        raise PluginError(f"layer backend 'te': transformer-engine failed to import "
                          f"({type(exc).__name__}: {exc}); {INSTALL_HINT}") from None
    return te


def _load_shard(param: torch.nn.Parameter, full: torch.Tensor, dim: int, rank: int, size: int,
                chunks: int | tuple[int, ...] = 1) -> None:
    """Overwrite TE's own init with this rank's shard of the layout-independent full tensor."""
    with torch.no_grad():
        param.copy_(shard_of(full, dim, rank, size, chunks).to(param.device, param.dtype))


@dataclass(frozen=True)
class _TensorParallelSettings:
    """plugtron's view of one linear layer, kept in one attribute whose name TE does not use
    (TE's modules have their own ``sequence_parallel``, ``tp_size``, ``tp_group``, ...)."""

    parallel: ParallelContext
    sequence_parallel: bool
    column: bool
    gather_output: bool
    input_is_parallel: bool
    skip_bias_add: bool
    partition_chunks: int | tuple[int, ...]


def _te_module_classes(te):
    """The TE subclasses this backend builds, defined once transformer-engine is imported.

    They subclass TE's modules (as Megatron-Core's TELinear does) instead of wrapping them, so a
    module's parameters are TE's own ``weight`` and ``bias`` with no extra level in the name:
    ``linear_qkv.weight`` under ``te`` as under ``local``.
    """
    delay_unavailable = cannot_delay_reason(te)  # None: this TE can delay its weight gradients

    class TensorParallelTELinear(te.Linear):
        """A local ``te.Linear`` over this rank's shard, between plugtron's collectives.

        A row-parallel bias must be added after the reduction over tp, so TE returns it
        (``return_bias``) instead of fusing it into the GEMM; it stays TE's ``bias``.

        Under a split backward its weight gradients (and a bias fused into the GEMM) wait for
        ``W`` through TE's own delayed wgrad (te_wgrad.py); a TE without it declares that they
        come at ``I``."""

        weight_grads_at_input = delay_unavailable

        def __init__(self, input_size, output_size, *, bias, init_method, settings):
            parallel = settings.parallel
            tp, rank = parallel.tp_size, parallel.tp_rank
            column = settings.column
            return_bias = bias and (settings.skip_bias_add or not column)
            delay = {} if delay_unavailable else {"delay_wgrad_compute": True}
            super().__init__(input_size if column else input_size // tp,
                             output_size // tp if column else output_size, bias=bias,
                             init_method=lambda weight: None, parallel_mode=None,
                             return_bias=return_bias, **delay)
            self._plugtron_tp = settings
            self._plugtron_gemm_bias = bias and not return_bias  # TE fuses it into the GEMM
            self._plugtron_wgrad = (None if delay_unavailable else DelayedWeightGrads(
                self.wgrad_store, type(self).__name__))
            dim, chunks = (0, settings.partition_chunks) if column else (1, 1)
            _load_shard(self.weight, init_method((output_size, input_size)), dim, rank, tp,
                        chunks)
            set_tensor_parallel(self.weight, dim, chunks)
            if bias:
                with torch.no_grad():
                    self.bias.zero_()
                if column:
                    set_tensor_parallel(self.bias, 0, chunks)
                elif settings.sequence_parallel:
                    mark_sequence_parallel(self.bias)

        def forward(self, x):
            settings = self._plugtron_tp
            group = settings.parallel.tp_group
            if settings.column:
                x = (gather_from_sequence_parallel_region(x, group)
                     if settings.sequence_parallel else copy_to_tensor_parallel_region(x, group))
            elif not settings.input_is_parallel:
                x = scatter_to_tensor_parallel_region(x, group)
            delayed = self._plugtron_wgrad
            out = (super().forward(x) if delayed is None else delayed.run(
                super().forward, x, self.weight, self.bias if self._plugtron_gemm_bias else None))
            out, bias = out if self.return_bias else (out, None)
            if settings.column:
                if settings.gather_output:
                    out = gather_from_tensor_parallel_region(
                        out, group, chunks=settings.partition_chunks)
                return out, bias
            out = (reduce_scatter_to_sequence_parallel_region(out, group)
                   if settings.sequence_parallel
                   else reduce_from_tensor_parallel_region(out, group))
            if settings.skip_bias_add or bias is None:
                return out, bias
            return out + bias, None

    class TECoreAttention(te.DotProductAttention):
        """TE's ``DotProductAttention`` with the interface's ``forward(q, k, v)`` (``bshd``).

        Under context parallelism TE's own cp is used (it expects the same load-balanced
        chunks ``r`` and ``2cp-1-r``); a TE without ``set_context_parallel_group`` falls back
        to plugtron's ``context_parallel_attention``."""

        #: (parallel, comm type, dropout stream) under cp; ``_plugtron_cp``: plugtron's cp
        #: attention runs every batch (a TE without its own cp), else only packed documents'
        _cp = None
        _plugtron_cp = False

        def use_context_parallel(self, parallel, comm_type, dropout_rng):
            self._cp = (parallel, comm_type, dropout_rng)
            if hasattr(self, "set_context_parallel_group"):
                self.set_context_parallel_group(
                    parallel.cp_group, list(parallel.cp_ranks), torch.cuda.Stream(),
                    _TE_CP_COMM_TYPES[comm_type])
            else:
                self._plugtron_cp = True

        def forward(self, q, k, v):
            documents = current_forward_context().document_ids
            if self._cp is not None and (self._plugtron_cp or documents is not None):
                parallel, comm_type, dropout_rng = self._cp
                p = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
                # TE forks its tracker only around its own dropout; plugtron's primitive draws
                # its mask seed from the current stream, so enter the layer's dropout stream as
                # local.CoreAttention does (else it would draw from the default stream).
                with dropout_rng():
                    return context_parallel_attention(q, k, v, parallel, comm_type, p,
                                                      documents)
            if documents is not None:
                return self._documents(q, k, v, documents)
            out = super().forward(q.contiguous(), k.contiguous(), v.contiguous())
            return out.reshape(q.shape[0], q.shape[1], -1)

        def _documents(self, q, k, v, documents):
            """Each document attending within itself: TE's THD format (Megatron's packed
            sequences), the batch's rows laid end to end, a document starting at each
            ``cu_seqlens`` entry."""
            b, s = q.shape[:2]
            runs = document_runs(documents)
            starts = [row * s + a for row, spans in enumerate(runs) for a, _ in spans]
            cu_seqlens = torch.tensor([*starts, b * s], dtype=torch.int32, device=q.device)
            longest = max(e - a for spans in runs for a, e in spans)
            q, k, v = (t.reshape(b * s, *t.shape[2:]).contiguous() for t in (q, k, v))
            out = super().forward(q, k, v, qkv_format="thd", attn_mask_type="padding_causal",
                                  cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                  max_seqlen_q=longest, max_seqlen_kv=longest)
            return out.reshape(b, s, -1)

    return TensorParallelTELinear, TECoreAttention


class TEBackend(LayerBackend):
    name = "te"
    supports_context_parallel = True  # TE's own cp, or plugtron's (see TECoreAttention)
    supports_document_ids = True  # TE's THD attention (plugtron's under cp)

    @classmethod
    def check_available(cls) -> None:
        import_transformer_engine()

    def __init__(self, config, parallel):
        self.te = import_transformer_engine()
        self._linear_class, self._attention_class = _te_module_classes(self.te)
        super().__init__(config, parallel)

    def _linear(self, input_size, output_size, bias, init_method, *, column, gather_output=False,
                input_is_parallel=True, skip_bias_add=False, partition_chunks=1):
        settings = _TensorParallelSettings(
            parallel=self.parallel, sequence_parallel=self.sequence_parallel, column=column,
            gather_output=gather_output, input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add, partition_chunks=partition_chunks)
        return self._linear_class(input_size, output_size, bias=bias, init_method=init_method,
                                  settings=settings)

    def column_parallel_linear(self, input_size, output_size, *, bias, init_method,
                               gather_output=False, skip_bias_add=False, partition_chunks=1):
        return self._linear(input_size, output_size, bias, init_method, column=True,
                            gather_output=gather_output, skip_bias_add=skip_bias_add,
                            partition_chunks=partition_chunks)

    def row_parallel_linear(self, input_size, output_size, *, bias, init_method,
                            input_is_parallel=True, skip_bias_add=False):
        if self.sequence_parallel and not input_is_parallel:
            raise ConfigError("a row-parallel linear under --sequence-parallel needs its input "
                              "already split over tp (input_is_parallel=True)")
        return self._linear(input_size, output_size, bias, init_method, column=False,
                            input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add)

    def norm(self, hidden_size):
        m = self.config.model
        cls = self.te.RMSNorm if m.normalization == "RMSNorm" else self.te.LayerNorm
        module = cls(hidden_size, eps=m.norm_epsilon)
        if self.sequence_parallel:
            mark_sequence_parallel(module)
        return module

    def core_attention(self, num_heads, num_query_groups, head_dim, dropout):
        # Counts are already this rank's (the model divided by tp); TE's tp arguments stay 1.
        module = self._attention_class(
            num_heads, head_dim, num_gqa_groups=num_query_groups, attention_dropout=dropout,
            qkv_format="bshd", attn_mask_type="causal",
            get_rng_state_tracker=lambda: self.rng_tracker)
        if self.parallel.cp_size > 1:
            module.use_context_parallel(self.parallel, self.config.parallel.cp_comm_type,
                                       self.dropout_rng)
        return module
