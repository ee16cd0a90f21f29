"""What a layer keeps for backward, as numbers: the contract through which a model tells the
memory estimate (core/tools/estimate.py) its activation bytes without the core knowing it.

A layer type (or any module of a model chunk) that can say what it saves for backward for one
microbatch defines ``activation_bytes(shape: ActivationShape) -> int``. The model chunk (the
module ``model_provider`` returns) defines the same method for the whole chunk; it adds its own
parts (embedding, output layer, loss) to its layers', which :func:`decoder_activations` sums
with ``--recompute-granularity full`` applied. The numbers are the bytes of the tensors autograd
saves (tests/core/tools/test_memory_estimate.py checks them against ``saved_tensors_hooks``), under the
local layer backend's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.core.training.recompute import recompute_plan


@dataclass(frozen=True)
class ActivationShape:
    """One microbatch on one rank, as a layer needs it to size what it saves.

    ``seq_length``: tokens of one sequence on this rank (``--seq-length / cp``);
    ``context_length``: keys each query attends (the whole sequence); ``dtype_bytes``: bytes
    of an activation element (fp32 4, bf16/fp16 2); ``mask_bytes``: bytes of a dropout-mask
    element (CUDA keeps bool masks, CPU kernels masks of the activation dtype); ``cuda``: the
    run is on GPUs (which attention kernel runs); ``sequence_parallel`` with ``tp``: the
    residual stream is split over tp; ``dtype``: the activations' dtype by name (``"fp32"``,
    ``"bf16"``, ``"fp16"``; empty where unknown), for kernels whose saved tensors depend on
    more than its width (on a CPU without matrix instructions for a half dtype the local
    backend's attention computes in fp32: its ``CoreAttention.kernel_dtype_bytes``).
    """

    micro_batch_size: int
    seq_length: int
    context_length: int
    tp: int = 1
    sequence_parallel: bool = False
    dtype_bytes: int = 4
    mask_bytes: int = 4
    cuda: bool = False
    dtype: str = ""

    @property
    def tokens(self) -> int:
        """Tokens of the microbatch on this rank (b x s / cp)."""
        return self.micro_batch_size * self.seq_length

    def tensor(self, width: int, dtype_bytes: int | None = None) -> int:
        """Bytes of a ``[b, s, width]`` activation (``width`` already this rank's share)."""
        return self.tokens * width * (self.dtype_bytes if dtype_bytes is None else dtype_bytes)

    def residual(self, width: int, dtype_bytes: int | None = None) -> int:
        """Bytes of a ``[b, s, width]`` tensor of the residual stream: split over tp under
        sequence parallelism."""
        share = self.tp if self.sequence_parallel else 1
        return self.tensor(width, dtype_bytes) // share

    def dropout_mask(self, width: int, p: float) -> int:
        """Bytes of a residual-stream dropout mask (none without dropout)."""
        return self.residual(width, self.mask_bytes) if p > 0 else 0


@dataclass(frozen=True)
class ChunkActivations:
    """``stored``: bytes one microbatch keeps on a chunk from its forward to its backward;
    ``recompute_peak``: bytes a recomputed group rebuilds during its backward (held once per
    rank, for the group being recomputed, not per microbatch in flight); ``held_for_weights``:
    bytes a split backward keeps from its ``I`` to its ``W`` (the deferred weight gradients'
    inputs and output gradients; ``None``: counted as ``stored``, the safe side)."""

    stored: int
    recompute_peak: int = 0
    held_for_weights: int | None = None

    @property
    def until_weights(self) -> int:
        return self.stored if self.held_for_weights is None else self.held_for_weights


def module_activation_bytes(module, shape: ActivationShape) -> int:
    """``module.activation_bytes(shape)``, or the sum over its parts for a module that does
    not say (a ``ComposedLayer``, a container): each child that says counts once."""
    own = getattr(module, "activation_bytes", None)
    if callable(own):
        return int(own(shape))
    return sum(module_activation_bytes(child, shape) for child in module.children())


def module_weight_grad_bytes(module, shape: ActivationShape) -> int:
    """``module.weight_grad_bytes(shape)`` (what a split backward keeps from ``I`` to ``W``),
    or the sum over its parts; a part that says neither this nor less is counted with its
    ``activation_bytes`` (all it keeps for backward, the safe side)."""
    own = getattr(module, "weight_grad_bytes", None)
    if callable(own):
        return int(own(shape))
    if callable(getattr(module, "activation_bytes", None)):
        return int(module.activation_bytes(shape))
    return sum(module_weight_grad_bytes(child, shape) for child in module.children())


def decoder_activations(layers, shape: ActivationShape, hidden_size: int,
                        config) -> ChunkActivations:
    """A chunk's decoder layers (in run order) under ``--recompute-granularity full``: a
    recomputed group keeps only its input (one residual-stream tensor) and rebuilds its layers'
    activations during its backward; the largest such group is the transient peak. What a
    split backward keeps for ``W`` is each layer's ``weight_grad_bytes`` (recomputed or not:
    the rerun forward builds the same deferrable graph)."""
    layers = list(layers)
    held = sum(module_weight_grad_bytes(layer, shape) for layer in layers)
    per_layer = [module_activation_bytes(layer, shape) for layer in layers]
    stored = peak = 0
    for start, end, again in recompute_plan(config, len(per_layer)):
        group = sum(per_layer[start:end])
        if again:
            stored += shape.residual(hidden_size)
            peak = max(peak, group)
        else:
            stored += group
    return ChunkActivations(stored, peak, held)
