"""The interface a tensor-parallel layer backend implements (entry-point group
``plugtron.layer_backends``).

A model builds every tensor-parallel building block through the backend the run selected, so the
same transformer layer runs on the ``local`` backend (plain torch plus plugtron's collectives) or
on ``te`` (transformer-engine) without changing. Activations are ``[batch, seq, hidden]``; under
sequence parallelism (SP) the ``seq`` dimension is sharded over tp outside tensor-parallel
regions, i.e. everywhere on the residual stream between the embedding's
:meth:`~LayerBackend.scatter_to_sequence_parallel` and :meth:`~LayerBackend.output_logits`.

Contracts every backend keeps:

* Linear layers return ``(output, bias)`` as Megatron's do: ``bias`` is ``None`` unless
  ``skip_bias_add`` asked for the bias to be returned instead of added (so it can be fused later).
* Weights are initialised layout-independently: the layer calls ``init_method(full_shape)`` and
  keeps ``core.sharding.shard_of`` of the result, and declares the split with
  ``core.sharding.set_tensor_parallel`` (dim, chunks). Replicated parameters are identical on
  every tp rank; those fed sequence-sharded activations under SP (norms, row-parallel biases)
  carry ``sequence_parallel = True`` so finalize sums their gradients over tp.
* Dropout inside tp regions draws from ``dropout_rng()`` (the model-parallel stream of
  :attr:`rng_tracker`, different on every tp rank).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from plugtron.core.blocks.init import InitMethod
from plugtron.core.config import validate_tensor_parallel
from plugtron.core.parallel import tensor_parallel as tpc
from plugtron.core.parallel.random import model_parallel_rng_tracker
from plugtron.core.parallel.vocab_parallel import (
    VocabParallelEmbedding,
    parallel_linear_cross_entropy,
    parallel_logits,
    vocab_parallel_cross_entropy,
)


class LayerBackend(ABC):
    """Factory of tensor-parallel layers for one run.

    Built once per run with the run's config and :class:`ParallelContext` (after the vocabulary
    is padded). It checks that the model sizes split over tp, and creates the run's
    :attr:`rng_tracker` (checkpoints save it with ``rng_tracker.get_state()``).
    """

    #: entry-point name, for messages
    name = "abstract"
    #: whether core_attention works under --cp > 1 (refused before launch otherwise)
    supports_context_parallel = False
    #: whether core_attention reads the forward context's document_ids (--reset-attention-mask)
    supports_document_ids = False
    #: whether it builds in plain torch on any device, the meta device included: the core
    #: takes such a backend for single-process reference builds (a file's expected shapes,
    #: ``load_model``) when the run's own cannot
    builds_anywhere = False

    def __init__(self, config, parallel):
        """``config``: the run's ``TrainConfig``; ``parallel``: its ``ParallelContext``. Checks
        that the model's sizes split over tp and creates :attr:`rng_tracker`; a subclass calls
        it first, then checks what its own layers need (``check_available``)."""
        self.config = config
        self.parallel = parallel
        validate_tensor_parallel(config, parallel.tp_size)
        self.rng_tracker = model_parallel_rng_tracker(config.training.seed, parallel)

    @classmethod
    def check_available(cls) -> None:
        """Raise ConfigError/PluginError if this backend cannot run on this machine (missing
        package or device). The CLI calls it before launching any rank."""

    @property
    def sequence_parallel(self) -> bool:
        """Whether this run shards the residual stream's sequence over tp (``--sequence-
        parallel``): layers then scatter and gather at their tp regions' edges."""
        return bool(self.config.parallel.sequence_parallel) and self.parallel.tp_size > 1

    @abstractmethod
    def column_parallel_linear(self, input_size: int, output_size: int, *, bias: bool,
                               init_method: InitMethod, gather_output: bool = False,
                               skip_bias_add: bool = False,
                               partition_chunks: int | tuple[int, ...] = 1
                               ) -> torch.nn.Module:
        """Linear with the output dimension split over tp. Input: replicated activations
        (sequence-sharded under SP, gathered inside). Output: this rank's slice of features, or
        all of them with ``gather_output``. ``partition_chunks``: the output is that many equal
        blocks (e.g. [gate; up]) split separately, so the local output is [gate_r; up_r]; or a
        tuple of the blocks' full sizes when they differ (a fused projection of unequal parts), each
        divisible by tp."""

    @abstractmethod
    def row_parallel_linear(self, input_size: int, output_size: int, *, bias: bool,
                            init_method: InitMethod, input_is_parallel: bool = True,
                            skip_bias_add: bool = False) -> torch.nn.Module:
        """Linear with the input dimension split over tp; the output is all-reduced over tp
        (reduce-scattered along the sequence under SP). The bias is replicated."""

    @abstractmethod
    def norm(self, hidden_size: int) -> torch.nn.Module:
        """The configured norm (LayerNorm or RMSNorm, ``config.model.norm_epsilon``); its
        params are marked ``sequence_parallel`` under SP."""

    @abstractmethod
    def core_attention(self, num_heads: int, num_query_groups: int, head_dim: int,
                       dropout: float) -> torch.nn.Module:
        """Causal attention over this rank's heads: ``num_heads`` and ``num_query_groups`` are the
        counts on this tensor-parallel rank (the global ones divided by tp), ``head_dim`` each
        head's width. ``forward(q, k, v)`` with q
        ``[b, s, heads, d]``, k and v ``[b, s, groups, d]`` returns ``[b, s, heads * d]``.
        Attention dropout draws from :meth:`dropout_rng`. Under context parallelism ``s`` is
        this cp rank's two sequence chunks (core/parallel/context_parallel.py) and the queries must
        attend to the keys of every cp rank (``--cp-comm-type``; the core's
        ``context_parallel_attention`` does it); a backend that does declares
        ``supports_context_parallel = True``."""

    # Defaults every backend can keep: plain torch over the run's tp group (core/parallel/vocab_parallel.py
    # and core/parallel/tensor_parallel.py). A backend overrides them to use fused kernels.

    def vocab_parallel_embedding(self, num_embeddings: int, embedding_dim: int, *,
                                 init_method: InitMethod) -> torch.nn.Module:
        """Embedding with contiguous vocabulary ranges per tp rank (``num_embeddings`` is the
        padded vocabulary). ``forward(ids)`` returns the full, replicated embeddings
        ``[b, s, hidden]``; the model adds positions and then calls
        :meth:`scatter_to_sequence_parallel`. Its ``weight`` is the shard ``[padded/tp, h]``
        (it doubles as the output layer's weight)."""
        return VocabParallelEmbedding(num_embeddings, embedding_dim, init_method=init_method,
                                      parallel=self.parallel)

    def output_logits(self, hidden: torch.Tensor, weight: torch.Tensor,
                      parallel_output: bool, *, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Logits from the final hidden states (sequence-sharded under SP: gathered here) and
        the vocab-sharded output weight: this rank's columns ``[b, s, padded/tp]`` with
        ``parallel_output``, else every column ``[b, s, padded]`` on every rank. ``bias``: an
        output layer's bias (GPT-J's), sharded like the weight's rows ``[padded/tp]`` (declare
        it with ``set_tensor_parallel(bias, 0)``; its padding entries are never read)."""
        return parallel_logits(hidden, weight, self.parallel.tp_group, self.sequence_parallel,
                               parallel_output, bias=bias)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      label_smoothing: float = 0.0) -> torch.Tensor:
        """Per-token loss ``[b, s]`` (fp32) from vocab-sharded logits (``parallel_output``);
        columns at or beyond ``vocab_size`` (padding) never win and never count. Equals torch's
        cross entropy (with its label-smoothing definition) on the gathered logits."""
        return vocab_parallel_cross_entropy(logits, labels, self.parallel.tp_group, vocab_size,
                                            label_smoothing)

    def output_losses(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      vocab_size: int, label_smoothing: float = 0.0) -> torch.Tensor:
        """The output layer and :meth:`cross_entropy` in one: per-token loss ``[b, s]`` (fp32)
        of the final hidden states (as :meth:`output_logits` takes them) against the
        vocab-sharded output weight, computed in chunks of tokens so that the logits never
        exist whole and the backward's passes over them stay in cache (what
        ``--cross-entropy-loss-fusion`` selects; ``plugtron.api.parallel_linear_cross_entropy``).
        The same loss as ``cross_entropy(output_logits(hidden, weight, True), ...)`` up to fp32
        rounding. A backend with a fused kernel of its own overrides it."""
        return parallel_linear_cross_entropy(hidden, weight, labels, self.parallel.tp_group,
                                             self.sequence_parallel, vocab_size,
                                             label_smoothing)

    def scatter_to_sequence_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shard replicated activations along the sequence under SP (identity otherwise)."""
        if not self.sequence_parallel:
            return hidden
        return tpc.scatter_to_sequence_parallel_region(hidden, self.parallel.tp_group)

    def gather_from_sequence_parallel(self, hidden: torch.Tensor,
                                      tensor_parallel_output_grad: bool = True) -> torch.Tensor:
        """Gather sequence-sharded activations (identity without SP). Pass
        ``tensor_parallel_output_grad=False`` when the consumer is replicated over tp."""
        if not self.sequence_parallel:
            return hidden
        return tpc.gather_from_sequence_parallel_region(
            hidden, self.parallel.tp_group,
            tensor_parallel_output_grad=tensor_parallel_output_grad)

    def gather_from_tensor_parallel(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate the tp ranks' last-dimension shards (e.g. vocab-sharded logits into
        ``[b, s, padded]``); backward keeps this rank's shard of the gradient."""
        return tpc.gather_from_tensor_parallel_region(tensor, self.parallel.tp_group)

    def dropout_rng(self):
        """Context manager under which dropout inside tp regions (and on sequence-sharded
        activations) draws its randomness: the model-parallel stream, which differs across tp
        ranks."""
        return self.rng_tracker.fork()
