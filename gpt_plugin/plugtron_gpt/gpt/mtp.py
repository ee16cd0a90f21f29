"""Multi-token prediction (DeepSeek-V3; ``--mtp-num-layers D``, ``--mtp-loss-scaling-factor``),
Megatron-Core's semantics and names, on the chunk that holds the output layer.

Depth k (1..D) predicts the token k+1 places ahead. With ``h_0`` the decoder's output after its
final norm and ``t`` the input tokens shifted left k times (the vacated last places zero, as
Megatron's ``roll_tensor``)::

    h_k = final_layernorm_k(layer_k(eh_proj_k([enorm_k(embed(t)); hnorm_k(h_{k-1})])))
    loss_k = masked mean of cross_entropy(output_layer(h_k), labels shifted k times)

with the loss mask shifted alongside (so a shifted-out position never counts). ``embed`` and
``output_layer`` are the model's own (shared weights); ``layer_k`` is a decoder layer of the
kind of the model's last one (attention and MLP, or MoE where the last layer is MoE), found by
symbol like every other. Each ``loss_k`` enters the objective as
``mtp_loss_scaling_factor / D x loss_k`` through the aux-loss channel (``add_loss``), weighted
by the microbatch's loss tokens like the main loss (Megatron's per-token mode), and is reported
unscaled as ``mtp_k loss`` (Megatron's name).

Under context parallelism the shift is over the whole sequence (the places k ahead of a cp
rank's chunks are on another rank: ``mtp_shift.ShiftedInputs``) and ``loss_k`` is the whole
microbatch's masked mean (sum and count added over the cp ranks); the hidden states are not
shifted, so each depth's attention is the model's own cp attention (any ``--cp-comm-type``).

Parameters: ``mtp.layers.{k-1}.{enorm,hnorm,eh_proj,final_layernorm}.*`` and
``mtp.layers.{k-1}.mtp_model_layer.*`` (Megatron-Core 0.19). On a last pipeline stage without the
embedding, the word embeddings are a copy shared with the first stage (``mtp_embedding``, or
the tied output layer itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from plugtron.api import (
    ComposedLayer,
    ConfigError,
    ConfigSection,
    add_loss,
    current_forward_context,
    load_layer_types,
    normal_init,
    opt,
    substitute_symbols,
    sum_over_context_parallel,
)
from plugtron_gpt.gpt.mtp_shift import ShiftedInputs, count_over_cp
from plugtron_gpt.layers.activations import norm_bytes


@dataclass
class MTPOptions:
    mtp_num_layers: int | None = opt(
        None, "--mtp-num-layers",
        "Multi-token prediction depth D: D extra layers after the decoder predict the tokens "
        "2..D+1 places ahead (DeepSeek-V3: 1). Default none.")
    mtp_loss_scaling_factor: float = opt(
        0.1, "--mtp-loss-scaling-factor",
        "Weight of the multi-token prediction losses: each depth's loss enters the objective "
        "times this / D.")


#: Declared by the gpt model plugin.
SECTION = ConfigSection("mtp", MTPOptions, title="Multi-token prediction")


def mtp_options(config) -> MTPOptions:
    """``config.mtp``, or the defaults (no MTP) where the config has no such section."""
    options = getattr(config, "mtp", None)
    return options if isinstance(options, MTPOptions) else MTPOptions()


#: What the GPT converters offer to leave out of an export (``--drop mtp``).
DROPPABLE = {"mtp": "the multi-token prediction layers"}


def drop_mtp(config, part: str) -> None:
    """``--drop mtp`` on export: the model without its MTP layers (the converters then ask for
    none of their tensors, and the exported config has no MTP depth)."""
    if part == "mtp" and isinstance(getattr(config, "mtp", None), MTPOptions):
        config.mtp.mtp_num_layers = None


def mtp_depth(config) -> int:
    return mtp_options(config).mtp_num_layers or 0


def validate_mtp(config) -> None:
    """Before launch: the depth and factor, and what MTP does not combine with."""
    o = mtp_options(config)
    if o.mtp_num_layers is None:
        return
    if o.mtp_num_layers < 1:
        raise ConfigError(f"--mtp-num-layers must be at least 1 (or unset), got "
                          f"{o.mtp_num_layers}")
    if o.mtp_loss_scaling_factor < 0:
        raise ConfigError(f"--mtp-loss-scaling-factor must be at least 0, got "
                          f"{o.mtp_loss_scaling_factor}")
    if config.model.position_embedding_type != "rope":
        raise ConfigError("--mtp-num-layers needs --position-embedding-type rope: the learned "
                          "position table lives on the first pipeline stage only")


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[b, s]`` shifted one place to the left along the sequence, the last place 0
    (Megatron's ``roll_tensor(shifts=-1)`` on one process; :class:`ShiftedInputs` is the
    shift the model runs, under cp too)."""
    return F.pad(t[:, 1:], (0, 1))


class MultiTokenPredictionLayer(torch.nn.Module):
    """One depth: the two norms, ``eh_proj`` (column-parallel, gathered), a decoder layer and
    its final norm."""

    def __init__(self, config, backend, parallel, depth: int, seed: int, symbols: str):
        super().__init__()
        m = config.model
        h = m.hidden_size
        prefix = f"mtp.layers.{depth}"
        self.backend = backend
        self.enorm = backend.norm(h)
        self.hnorm = backend.norm(h)
        self.eh_proj = backend.column_parallel_linear(
            2 * h, h, bias=False, gather_output=True,
            init_method=normal_init(m.init_method_std, seed, f"{prefix}.eh_proj.weight"))
        # Built as layer L + depth + 1 (1-based): its init keys follow the decoder's layers.
        layer_types = load_layer_types(symbols)
        number = m.num_layers + depth + 1
        self.mtp_model_layer = ComposedLayer(
            [layer_types[symbol](config, backend, parallel, number, seed) for symbol in symbols])
        self.final_layernorm = backend.norm(h)

    def forward(self, hidden, embedded, rotary=None):
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x, _ = self.eh_proj(x)  # every feature, every token (gathered under sp)
        x = self.backend.scatter_to_sequence_parallel(x)
        return self.final_layernorm(self.mtp_model_layer(x, rotary))


class MultiTokenPrediction(torch.nn.Module):
    """``mtp``: the D depths."""

    def __init__(self, config, backend, parallel, seed: int, layer_pattern: str):
        super().__init__()
        o, m = mtp_options(config), config.model
        # Each depth is a decoder layer of the kind the model's last one is (E on an MoE model
        # whose last layer is MoE), as the registry answers for that layer.
        symbols = substitute_symbols(layer_pattern, config, [m.num_layers])[m.num_layers]
        self.layers = torch.nn.ModuleList(
            [MultiTokenPredictionLayer(config, backend, parallel, depth, seed, symbols)
             for depth in range(mtp_depth(config))])
        self.scale = o.mtp_loss_scaling_factor / mtp_depth(config)
        self.cp_group = parallel.cp_group  # the shift and the losses span the whole sequence

    def forward(self, hidden, tokens, position_ids, labels, loss_mask, rotary, embed,
                token_losses):
        """``hidden`` (the decoder's normed output) with each depth's loss attached
        (``add_loss``); ``embed(tokens, position_ids)`` and ``token_losses(hidden, labels)``
        are the model's embedding and output layer with its cross entropy."""
        out, h = hidden, hidden
        shifted = ShiftedInputs([tokens, position_ids, labels, loss_mask.float()],
                                len(self.layers), self.cp_group,
                                current_forward_context().document_ids)
        for k, layer in enumerate(self.layers, start=1):
            tokens, position_ids, labels, mask = shifted.at(k)
            h = layer(h, embed(tokens, position_ids), rotary)
            losses = token_losses(h, labels).float()
            # The mean over the whole microbatch, each cp rank holding its share of the sum.
            total = sum_over_context_parallel((losses * mask).sum(), self.cp_group)
            mean = total / count_over_cp(mask, self.cp_group).clamp(min=1)
            # Reported unscaled (Megatron's mtp_k loss); the objective gets scale x mean.
            term = self.scale * mean + (1 - self.scale) * mean.detach()
            out = add_loss(out, f"mtp_{k} loss", term)
        return out


def mtp_layer_bytes(layer: torch.nn.Module, shape, normalization: str, vocab: int,
                    fused_loss: bool = False) -> int:
    """What one depth keeps for backward per microbatch (``plugtron estimate``): its two input
    norms, ``eh_proj``'s input, its decoder layer, its final norm, and the output layer's input
    and fp32 softmax (with ``fused_loss``, ``--cross-entropy-loss-fusion``: one log-sum-exp
    and the label's shard position per token instead) with the shifted labels and mask."""
    h = layer.get_parameter("enorm.weight").shape[0]
    total = 2 * norm_bytes(shape, h, normalization) + shape.residual(2 * h)
    composed: Any = layer.get_submodule("mtp_model_layer")  # a ComposedLayer
    total += int(composed.activation_bytes(shape))
    total += norm_bytes(shape, h, normalization) + shape.tensor(h)
    loss = shape.tensor(1, 4) + shape.tensor(1, 9) if fused_loss else shape.tensor(vocab, 4)
    return total + loss + shape.tensor(3, 8)
