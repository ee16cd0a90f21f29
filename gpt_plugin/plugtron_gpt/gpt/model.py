"""GPTModel: one pipeline chunk of a decoder-only transformer.

The first chunk owns the embedding, the last the final norm, output layer and loss; the others
take their input through ``set_input_tensor``. Every tensor-parallel piece comes from the layer
backend the run selected, and the decoder is composed from layer types found by symbol.

Parameter names are Megatron-Core's and the same under every layout and layer backend:
``embedding.word_embeddings.weight``, ``embedding.position_embeddings.weight`` (first stage),
``decoder.layers.{i}.{input_layernorm,self_attention,pre_mlp_layernorm,mlp}.*`` (i global),
``decoder.final_layernorm.*`` and ``output_layer.weight`` (last stage; untied, or the tied copy
when the embedding lives on another stage).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from plugtron.api import (
    ChunkActivations,
    ComposedLayer,
    chunk_layers,
    decoder_activations,
    forward_context,
    load_layer_types,
    normal_init,
    rotary_freqs_at,
    share_parameter,
    substitute_symbols,
)
from plugtron_gpt.gpt.mtp import MultiTokenPrediction, mtp_depth, mtp_layer_bytes
from plugtron_gpt.layers.attention import dropout
from plugtron_gpt.layers.attention_options import rope_scaling, rotary_dim
from plugtron_gpt.layers.decoder import Decoder

#: The symbols of one GPT transformer layer: attention then MLP, under one layer index.
GPT_LAYER = "*-"
WORD_EMBEDDING_KEY = "embedding.word_embeddings.weight"
POSITION_EMBEDDING_KEY = "embedding.position_embeddings.weight"
OUTPUT_LAYER_KEY = "output_layer.weight"


def gpt_layer_symbols(config) -> str:
    """Every symbol the GPT decoder runs over all its layers, after installed layer types have
    claimed their slots (``E`` for ``-`` on MoE layers): what validation must check, since
    ``GPT_LAYER`` alone names only the types before substitution."""
    numbers = range(1, config.model.num_layers + 1)
    return "".join(substitute_symbols(GPT_LAYER, config, numbers).values())


class GPTEmbedding(torch.nn.Module):
    def __init__(self, config, backend, seed: int, learned_positions: bool = True):
        super().__init__()
        m = config.model
        self.backend = backend
        init = normal_init(m.init_method_std, seed, WORD_EMBEDDING_KEY)
        self.word_embeddings = backend.vocab_parallel_embedding(m.padded_vocab_size,
                                                                m.hidden_size, init_method=init)
        self.position_embeddings = None
        if learned_positions and m.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                m.max_position_embeddings or m.seq_length, m.hidden_size)
            with torch.no_grad():
                self.position_embeddings.weight.copy_(normal_init(
                    m.init_method_std, seed, POSITION_EMBEDDING_KEY)(
                    tuple(self.position_embeddings.weight.shape)))
        self.dropout = m.hidden_dropout

    def forward(self, tokens, position_ids):
        hidden = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)
        hidden = self.backend.scatter_to_sequence_parallel(hidden)
        return dropout(hidden, self.dropout, self.training, self.backend)


class GPTModel(torch.nn.Module):
    """A GPT chunk; subclasses change which layer types make each decoder layer
    (:meth:`layer_plan`) and whether there are learned position embeddings (the Hybrid model)."""

    #: Learned absolute position embeddings when --position-embedding-type asks for them.
    learned_positions = True

    def __init__(self, config, backend, parallel, pre_process: bool, post_process: bool,
                 vp_stage: int | None = None, layer_symbols: str = GPT_LAYER):
        super().__init__()
        m = config.model
        seed = config.training.seed
        self.config, self.backend, self.parallel = config, backend, parallel
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None
        plan = self.layer_plan(config, parallel, vp_stage, layer_symbols)
        if pre_process:
            self.embedding = GPTEmbedding(config, backend, seed, self.learned_positions)
        layer_types = load_layer_types("".join(plan.values()))
        # One decoder layer runs its symbols' layer types in order under one global index; their
        # children sit directly under decoder.layers.{i} (Megatron-Core's names).
        layers = {}
        for index, symbols in plan.items():
            parts = [layer_types[symbol](config, backend, parallel, index + 1, seed)
                     for symbol in symbols]
            layers[index] = ComposedLayer(parts)
        self.decoder = Decoder(layers, backend.norm(m.hidden_size) if post_process else None,
                               config=config)
        self.use_rotary = m.position_embedding_type == "rope"
        self.head_dim = rotary_dim(config)  # the channels rope turns per head
        self.rope_scaling = rope_scaling(config)
        self.output_layer = None
        if post_process and (m.untie_embeddings_and_output_weights or not pre_process):
            key = OUTPUT_LAYER_KEY if m.untie_embeddings_and_output_weights else WORD_EMBEDDING_KEY
            # Tied across stages: the same key gives the output layer the embedding's init.
            self.output_layer = backend.vocab_parallel_embedding(
                m.padded_vocab_size, m.hidden_size,
                init_method=normal_init(m.init_method_std, seed, key))
        # Multi-token prediction (--mtp-num-layers) on the chunk with the output layer; it
        # embeds shifted tokens, so a last stage without the embedding gets a shared copy of
        # the word embeddings (the tied output layer is one already).
        self.mtp = self.mtp_embedding = None
        if post_process and mtp_depth(config):
            self.mtp = MultiTokenPrediction(config, backend, parallel, seed, layer_symbols)
            if not pre_process and m.untie_embeddings_and_output_weights:
                self.mtp_embedding = backend.vocab_parallel_embedding(
                    m.padded_vocab_size, m.hidden_size,
                    init_method=normal_init(m.init_method_std, seed, WORD_EMBEDDING_KEY))
        shares = (not m.untie_embeddings_and_output_weights
                  or bool(mtp_depth(config)))
        if shares and parallel.pp_size > 1:
            for weight in self.shared_embedding_weights():
                share_parameter(weight, WORD_EMBEDDING_KEY)

    def layer_plan(self, config, parallel, vp_stage, layer_symbols: str) -> dict[int, str]:
        """``{global layer index: its symbols}`` for this chunk: every GPT layer is ``*-``."""
        p = config.parallel
        indices = chunk_layers(config.model.num_layers, parallel.pp_size, parallel.pp_rank,
                               p.virtual_pipeline_model_parallel_size, vp_stage,
                               p.decoder_first_pipeline_num_layers,
                               p.decoder_last_pipeline_num_layers, parallel.pipeline_placement)
        # An installed layer type may take a slot of the pattern at some layers (the MoE layer
        # `E` replaces `-` where --num-experts and --moe-layer-freq say); the registry answers.
        symbols_at = substitute_symbols(layer_symbols, config, [index + 1 for index in indices])
        return {index: symbols_at[index + 1] for index in indices}

    def activation_bytes(self, shape) -> ChunkActivations:
        """What one microbatch keeps on this chunk for backward (``plugtron estimate``): token
        and position ids and the embedding's dropout mask (first stage), the decoder layers
        (full recompute applied), and the final norm, output layer input and the loss's fp32
        softmax over this rank's vocabulary share (last stage)."""
        m = self.config.model
        h = m.hidden_size
        decoder = decoder_activations(self.decoder.layers.values(), shape, h, self.config)
        stored, held = decoder.stored, decoder.until_weights
        if self.pre_process:
            stored += shape.tensor(2, 8) + shape.dropout_mask(h, m.hidden_dropout)
            held += shape.tensor(1, 8) + shape.tensor(h)  # the embedding's ids and gradient
        if self.post_process:
            vocab = self.output_weight().shape[0]
            stored += shape.residual(h) + shape.residual(2, 4)  # final norm input and stats
            stored += shape.tensor(h)  # output layer input (gathered under sp)
            if m.cross_entropy_loss_fusion:  # log-partitions, labels and their shard's own
                stored += shape.tensor(1, 4) + shape.tensor(2, 8) + shape.tensor(1, 1)
                # from I to W: the final norm's, the output layer's input, what W recomputes
                # the logits' gradient from (log-partitions and the tokens' gradients)
                held += 2 * shape.residual(h) + shape.tensor(h) + shape.tensor(2, 4)
            else:
                stored += shape.tensor(vocab, 4) + shape.tensor(1, 8)  # softmax, labels
                # from I to W: the final norm's, the output layer's input, the logits' gradient
                held += 2 * shape.residual(h) + shape.tensor(h) + shape.tensor(vocab)
            if self.mtp is not None:
                mtp = sum(mtp_layer_bytes(layer, shape, m.normalization, vocab,
                                          m.cross_entropy_loss_fusion)
                          for layer in self.mtp.layers)
                stored += mtp
                held += mtp  # what their deferred weights keep: counted as what they store
        return ChunkActivations(stored, decoder.recompute_peak, held)

    def shared_embedding_weights(self) -> list[torch.nn.Parameter]:
        """The copies of the word embeddings this chunk holds: the embedding (first stage),
        and on the last stage the tied output layer or multi-token prediction's copy."""
        out = []
        if self.pre_process:
            out.append(self.embedding.word_embeddings.weight)
        untied = self.config.model.untie_embeddings_and_output_weights
        if self.post_process and self.output_layer is not None and not untied:
            out.append(self.output_layer.weight)
        if self.mtp_embedding is not None:
            out.append(self.mtp_embedding.weight)
        return out

    def _mtp_embed(self, tokens, position_ids):
        """The word embeddings of (shifted) tokens for multi-token prediction, sequence-
        sharded under sp, with the embedding's dropout."""
        if self.pre_process:
            return self.embedding(tokens, position_ids)
        table = self.mtp_embedding if self.mtp_embedding is not None else self.output_layer
        hidden = self.backend.scatter_to_sequence_parallel(table(tokens))
        return dropout(hidden, self.config.model.hidden_dropout, self.training, self.backend)

    def _token_losses(self, hidden, labels):
        """Per-token cross entropy ``[b, s]`` of the output layer on ``hidden``."""
        m = self.config.model
        if m.cross_entropy_loss_fusion:
            return self.backend.output_losses(hidden, self.output_weight(), labels,
                                              m.vocab_size, m.label_smoothing)
        logits = self.backend.output_logits(hidden, self.output_weight(), m.parallel_output)
        if not m.parallel_output:
            return F.cross_entropy(logits[..., :m.vocab_size].float().flatten(0, 1),
                                   labels.flatten(), reduction="none",
                                   label_smoothing=m.label_smoothing).view_as(labels)
        return self.backend.cross_entropy(logits, labels, m.vocab_size, m.label_smoothing)

    def output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def set_input_tensor(self, tensor) -> None:
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0]
        self.input_tensor = tensor

    def forward(self, tokens, position_ids=None, labels=None, document_ids=None,
                loss_mask=None):
        """Logits, or with ``labels`` the per-token loss, on the last stage; the hidden states
        elsewhere. ``position_ids`` default to 0..seq-1 (``model(tokens)`` gives logits).
        ``document_ids`` (``[b, s]``, the batch's ``attention_mask`` under
        ``--reset-attention-mask``): attention stays within each packed document.
        ``loss_mask`` (with ``labels``): multi-token prediction's losses are added (and
        reported) through the aux-loss channel; without it they are not computed."""
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        hidden = self.embedding(tokens, position_ids) if self.pre_process else self.input_tensor
        rotary = None
        if self.use_rotary:  # at the batch's true positions (a cp rank's chunks are apart)
            rotary = rotary_freqs_at(position_ids, self.head_dim, self.config.model.rotary_base,
                                     self.rope_scaling)
        mtp = self.mtp is not None and labels is not None and loss_mask is not None
        with (forward_context(document_ids=document_ids) if document_ids is not None
              else contextlib.nullcontext()):  # else keep a context the caller set
            hidden = self.decoder(hidden, rotary)
            if mtp:
                hidden = self.mtp(hidden, tokens, position_ids, labels, loss_mask, rotary,
                                  self._mtp_embed, self._token_losses)
        if not self.post_process:
            return hidden
        if labels is None:
            m = self.config.model
            return self.backend.output_logits(hidden, self.output_weight(), m.parallel_output)
        return self._token_losses(hidden, labels)
