"""The interface a tensor-parallel layer backend implements (entry-point group
``plugtron.layer_backends``).

A model builds every tensor-parallel building block through the backend the run selected, so the
same transformer layer runs on the ``local`` backend (plain torch plus plugtron's collectives) or
on ``te`` (transformer-engine) without changing. Activations are ``[batch, seq, hidden]``; under
sequence parallelism the ``seq`` dimension is sharded over tp outside tensor-parallel regions.

Linear layers return ``(output, bias)`` as Megatron's do: ``bias`` is ``None`` unless
``skip_bias_add`` asked for the bias to be returned instead of added (so it can be fused later).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .init import InitMethod


class LayerBackend(ABC):
    """Factory of tensor-parallel layers for one run."""

    #: entry-point name, for messages
    name = "abstract"

    def __init__(self, config, parallel):
        self.config = config
        self.parallel = parallel

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.config.parallel.sequence_parallel) and self.parallel.tp_size > 1

    @abstractmethod
    def column_parallel_linear(self, input_size: int, output_size: int, *, bias: bool,
                               init_method: InitMethod, gather_output: bool = False,
                               skip_bias_add: bool = False,
                               partition_chunks: int = 1) -> torch.nn.Module:
        """Linear with the output dimension split over tp. Input: replicated activations
        (sequence-sharded under SP, gathered inside). Output: this rank's slice of features, or
        all of them with ``gather_output``. ``partition_chunks``: the output is that many
        blocks (e.g. [gate; up]) split separately."""

    @abstractmethod
    def row_parallel_linear(self, input_size: int, output_size: int, *, bias: bool,
                            init_method: InitMethod, input_is_parallel: bool = True,
                            skip_bias_add: bool = False) -> torch.nn.Module:
        """Linear with the input dimension split over tp; the output is all-reduced over tp
        (reduce-scattered along the sequence under SP)."""

    @abstractmethod
    def vocab_parallel_embedding(self, num_embeddings: int, embedding_dim: int, *,
                                 init_method: InitMethod) -> torch.nn.Module:
        """Embedding with contiguous vocabulary ranges per tp rank. ``forward(ids)`` returns the
        full embeddings (sequence-sharded under SP). Its ``weight`` is the shard."""

    @abstractmethod
    def norm(self, hidden_size: int) -> torch.nn.Module:
        """The configured norm (LayerNorm or RMSNorm, ``config.model.norm_epsilon``)."""

    @abstractmethod
    def core_attention(self, num_heads: int, num_query_groups: int, head_dim: int,
                       dropout: float) -> torch.nn.Module:
        """Causal attention over this rank's heads: ``forward(q, k, v)`` with q
        ``[b, s, heads, d]``, k and v ``[b, s, groups, d]`` returns ``[b, s, heads * d]``."""

    @abstractmethod
    def output_logits(self, hidden: torch.Tensor, weight: torch.Tensor,
                      parallel_output: bool) -> torch.Tensor:
        """Logits ``[b, s, vocab/tp]`` (or gathered ``[b, s, vocab]``) from the final hidden
        states (sequence-sharded under SP) and the (vocab-sharded) output weight."""

    @abstractmethod
    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      label_smoothing: float = 0.0) -> torch.Tensor:
        """Per-token loss ``[b, s]`` from logits that may be vocab-sharded; columns at or
        beyond ``vocab_size`` (padding) never win and never count."""

    def scatter_to_sequence_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shard replicated activations along the sequence under SP (identity otherwise)."""
        return hidden

    def gather_from_sequence_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gather sequence-sharded activations (identity without SP)."""
        return hidden

    def dropout_rng(self):
        """Context manager under which dropout inside tp regions draws its randomness
        (differs across tp ranks); a no-op context by default."""
        import contextlib

        return contextlib.nullcontext()
