"""Layer backend ``te``: the layer-backend interface over transformer_engine.pytorch.

transformer-engine is imported only when this backend is selected (``--layer-backend te``), so
machines without it are unaffected. Selecting it without CUDA is a ConfigError; without
transformer-engine a PluginError that says what to install.

Design choice: TE computes (fused GEMMs, fused norms, fused attention) but plugtron's own
collectives (core/tensor_parallel.py) do the tensor- and sequence-parallel communication. TE's
built-in sequence parallelism splits dimension 0 of sequence-first ``[s, b, h]`` activations,
while plugtron's activations are batch-first ``[b, s, h]``; keeping TE's modules local
(``parallel_mode=None``) keeps one set of communication semantics for every backend.
Consequently TE's communication/GEMM overlap is not used.
"""

from __future__ import annotations

import importlib.util

import torch
from plugtron.core import tensor_parallel as tpc
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.layer_backend import LayerBackend
from plugtron.core.sharding import mark_sequence_parallel, set_tensor_parallel, shard_of

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
        import transformer_engine.pytorch as te
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        raise PluginError(f"layer backend 'te': transformer-engine failed to import "
                          f"({type(exc).__name__}: {exc}); {INSTALL_HINT}") from None
    return te


def _load_shard(param: torch.nn.Parameter, full: torch.Tensor, dim: int, rank: int, size: int,
                chunks: int = 1) -> None:
    """Overwrite TE's own init with this rank's shard of the layout-independent full tensor."""
    with torch.no_grad():
        param.copy_(shard_of(full, dim, rank, size, chunks).to(param.device, param.dtype))


class _TELinear(torch.nn.Module):
    """A local ``te.Linear`` on this rank's shard, between plugtron's collectives."""

    def __init__(self, te, input_size, output_size, *, bias, init_method, parallel,
                 sequence_parallel, column: bool, gather_output=False, input_is_parallel=True,
                 skip_bias_add=False, partition_chunks=1):
        super().__init__()
        self._parallel = parallel
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.column, self.sequence_parallel = column, sequence_parallel
        self.gather_output, self.input_is_parallel = gather_output, input_is_parallel
        self.skip_bias_add, self.partition_chunks = skip_bias_add, partition_chunks
        dim = 0 if column else 1
        local_in = input_size if column else input_size // tp
        local_out = output_size // tp if column else output_size
        # TE owns the GEMM: bias is kept out of it for row layers (added after the reduction).
        self.returns_bias = bias and column and skip_bias_add
        self.linear = te.Linear(local_in, local_out, bias=bias and column,
                                init_method=lambda weight: None, parallel_mode=None,
                                return_bias=self.returns_bias)
        _load_shard(self.linear.weight, init_method((output_size, input_size)), dim, rank, tp,
                    partition_chunks if column else 1)
        set_tensor_parallel(self.linear.weight, dim, partition_chunks if column else 1)
        self.bias = None
        if bias and column:
            with torch.no_grad():
                self.linear.bias.zero_()
            set_tensor_parallel(self.linear.bias, 0, partition_chunks)
        elif bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, device="cuda"))
            if sequence_parallel:
                self.bias.sequence_parallel = True

    def forward(self, x):
        group = self._parallel.tp_group
        if self.column:
            x = (tpc.gather_from_sequence_parallel_region(x, group) if self.sequence_parallel
                 else tpc.copy_to_tensor_parallel_region(x, group))
            out = self.linear(x)
            out, bias = out if self.returns_bias else (out, None)
            if self.gather_output:
                out = tpc.gather_from_tensor_parallel_region(out, group,
                                                             chunks=self.partition_chunks)
            return out, bias
        if not self.input_is_parallel:
            x = tpc.scatter_to_tensor_parallel_region(x, group)
        out = self.linear(x)
        out = (tpc.reduce_scatter_to_sequence_parallel_region(out, group)
               if self.sequence_parallel else tpc.reduce_from_tensor_parallel_region(out, group))
        if self.skip_bias_add or self.bias is None:
            return out, self.bias
        return out + self.bias, None


class TEBackend(LayerBackend):
    name = "te"

    @classmethod
    def check_available(cls) -> None:
        import_transformer_engine()

    def __init__(self, config, parallel):
        self.te = import_transformer_engine()
        super().__init__(config, parallel)

    def column_parallel_linear(self, input_size, output_size, *, bias, init_method,
                               gather_output=False, skip_bias_add=False, partition_chunks=1):
        return _TELinear(self.te, input_size, output_size, bias=bias, init_method=init_method,
                         parallel=self.parallel, sequence_parallel=self.sequence_parallel,
                         column=True, gather_output=gather_output, skip_bias_add=skip_bias_add,
                         partition_chunks=partition_chunks)

    def row_parallel_linear(self, input_size, output_size, *, bias, init_method,
                            input_is_parallel=True, skip_bias_add=False):
        if self.sequence_parallel and not input_is_parallel:
            raise ConfigError("a row-parallel linear under --sequence-parallel needs its input "
                              "already split over tp (input_is_parallel=True)")
        return _TELinear(self.te, input_size, output_size, bias=bias, init_method=init_method,
                         parallel=self.parallel, sequence_parallel=self.sequence_parallel,
                         column=False, input_is_parallel=input_is_parallel,
                         skip_bias_add=skip_bias_add)

    def norm(self, hidden_size):
        m = self.config.model
        cls = self.te.RMSNorm if m.normalization == "RMSNorm" else self.te.LayerNorm
        module = cls(hidden_size, eps=m.norm_epsilon)
        if self.sequence_parallel:
            mark_sequence_parallel(module)
        return module

    def core_attention(self, num_heads, num_query_groups, head_dim, dropout):
        # Counts are already this rank's (the model divided by tp); TE's tp arguments stay 1.
        attention = self.te.DotProductAttention(
            num_heads, head_dim, num_gqa_groups=num_query_groups, attention_dropout=dropout,
            qkv_format="bshd", attn_mask_type="causal",
            get_rng_state_tracker=lambda: self.rng_tracker)
        return _TEAttention(attention)


class _TEAttention(torch.nn.Module):
    """TE's ``DotProductAttention`` with the interface's ``forward(q, k, v)`` (``bshd``)."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, q, k, v):
        out = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
        return out.reshape(q.shape[0], q.shape[1], -1)
