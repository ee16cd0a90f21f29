"""Multi-latent attention (DeepSeek-V2/V3; ``--multi-latent-attention``): ``self_attention`` of
an attention layer ``*`` whose keys and values come from a compressed latent.

Per token, with Megatron-Core's names under ``decoder.layers.{i}.self_attention``:

* queries: ``linear_q_down_proj`` (hidden -> ``--q-lora-rank``), ``q_layernorm``,
  ``linear_q_up_proj`` (-> heads x (``--qk-head-dim`` + ``--qk-pos-emb-head-dim``)); without
  ``--q-lora-rank`` one ``linear_q_proj`` instead;
* keys and values: ``linear_kv_down_proj`` (hidden -> ``--kv-lora-rank`` +
  ``--qk-pos-emb-head-dim``), whose first part goes through ``kv_layernorm`` and
  ``linear_kv_up_proj`` (-> heads x (``--qk-head-dim`` + ``--v-head-dim``)); its last part is
  the rotary key, one for all heads (DeepSeek's shared rope key);
* rotary position on the ``--qk-pos-emb-head-dim`` channels only (the decoupled part), in
  DeepSeek's interleaved-pair layout; a head's key is ``[k_nope; k_rope]``, its query
  ``[q_nope; q_rope]``; softmax scale ``1/sqrt(qk + pos)`` (times YaRN's correction);
* ``linear_proj``: heads x ``--v-head-dim`` -> hidden.

Generation (an ``InferenceState`` in the forward context) caches the normed latent and the
rotated shared key, ``--kv-lora-rank`` + ``--qk-pos-emb-head-dim`` values per token and layer,
not the expanded keys and values (heads x (``--qk-head-dim`` + ``--qk-pos-emb-head-dim`` +
``--v-head-dim``)); each step rebuilds the keys and values of the whole cached prefix with
``linear_kv_up_proj``, as the full-sequence forward computes them, so cached and uncached
generation agree.

With ``--qk-clip`` a training forward records each head's largest logit with the query and
key up-projections, whose rows it declares per head (Megatron-Core's MLA clip: ``q_nope`` and
``k_nope`` share the scale by ``--qk-clip-alpha``, ``q_rope`` takes all of it, the shared
rotary key none).

Tensor parallelism splits the heads: the up-projections are column-parallel, ``linear_proj``
row-parallel, and the down-projections and latent norms are replicated on every tp rank, as in
Megatron-Core. Gradients: without sequence parallelism the up-projections' backward sums their
input gradient over tp, and the shared rotary key, used by this rank's heads only, enters the tp
region explicitly (its gradient summed over tp); under sequence parallelism the down-projections
see this rank's tokens, so their weights (and the norms) are marked ``sequence_parallel``
(summed over tp in finalize) and the rotary key is gathered along the sequence (its gradient
reduce-scattered).
"""

from __future__ import annotations

import torch
from plugtron.api import (
    apply_rotary,
    copy_to_tensor_parallel_region,
    current_forward_context,
    linear,
    mark_qk_clip_rows,
    mark_sequence_parallel,
    normal_init,
    recompute,
    recompute_module,
    record_max_logits,
    scaled_normal_init,
    yarn_attention_factor,
    yarn_mscale,
)
from plugtron_gpt.layers.attention_logits import layer_max_logits
from plugtron_gpt.layers.attention_options import attention_options, parse_window, rope_scaling


class ReplicatedLinear(torch.nn.Module):
    """``x @ weight.T`` with the whole weight on every tp rank (an MLA down-projection).
    ``sequence_parallel``: fed this rank's tokens, so finalize sums its gradient over tp."""

    def __init__(self, input_size: int, output_size: int, init_method,
                 sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(init_method((output_size, input_size)))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class MultiLatentAttention(torch.nn.Module):
    """Down-projections, latent norms, up-projections, decoupled rotary, core attention and
    output projection over this rank's heads (no input norm, no residual)."""

    def __init__(self, config, backend, parallel, prefix: str, seed: int):
        super().__init__()
        m, o = config.model, attention_options(config)
        tp = parallel.tp_size
        self.backend, self.parallel = backend, parallel
        self.cache_key = prefix  # this layer's entry in a generation's KV cache
        heads = m.num_attention_heads
        self.num_heads = self.num_groups = heads // tp
        self.qk_head_dim, self.pos_dim = o.qk_head_dim, o.qk_pos_emb_head_dim
        self.v_head_dim, self.kv_lora_rank = o.v_head_dim, o.kv_lora_rank
        self.q_head_dim = o.qk_head_dim + o.qk_pos_emb_head_dim
        sp = backend.sequence_parallel

        def init(name):
            return normal_init(m.init_method_std, seed, f"{prefix}.{name}.weight")

        self.q_layernorm = None
        if o.q_lora_rank is None:
            self.linear_q_proj = backend.column_parallel_linear(
                m.hidden_size, heads * self.q_head_dim, bias=False,
                init_method=init("linear_q_proj"))
        else:
            self.linear_q_down_proj = ReplicatedLinear(m.hidden_size, o.q_lora_rank,
                                                       init("linear_q_down_proj"), sp)
            self.q_layernorm = backend.norm(o.q_lora_rank)
            self.linear_q_up_proj = backend.column_parallel_linear(
                o.q_lora_rank, heads * self.q_head_dim, bias=False,
                init_method=init("linear_q_up_proj"))
        self.linear_kv_down_proj = ReplicatedLinear(
            m.hidden_size, o.kv_lora_rank + o.qk_pos_emb_head_dim, init("linear_kv_down_proj"),
            sp)
        self.kv_layernorm = backend.norm(o.kv_lora_rank)
        self.linear_kv_up_proj = backend.column_parallel_linear(
            o.kv_lora_rank, heads * (o.qk_head_dim + o.v_head_dim), bias=False,
            init_method=init("linear_kv_up_proj"))
        window = parse_window(o.window_size)
        self.window = window  # what QK-clip's logits cover too
        extra = {"window_size": window} if window is not None else {}
        self.core_attention = backend.core_attention(self.num_heads, self.num_heads,
                                                     self.q_head_dim, m.attention_dropout,
                                                     **extra)
        self.linear_proj = backend.row_parallel_linear(
            heads * o.v_head_dim, m.hidden_size, bias=m.add_bias_linear,
            init_method=scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                           f"{prefix}.linear_proj.weight"),
            input_is_parallel=True)
        self.recompute_core = recompute_module(config, "core_attn")
        self.qk_clip = config.training.qk_clip
        if self.qk_clip:
            self._declare_qk_clip_rows(heads)
        #: cos and sin times this (YaRN's attention factor), and the queries times
        #: ``query_scale`` (YaRN's softmax-scale correction; 1 without YaRN)
        self.rotary_mscale, self.query_scale = mla_scales(config)

    def _query_weight(self) -> torch.nn.Parameter:
        return (self.linear_q_proj if self.q_layernorm is None else self.linear_q_up_proj).weight

    def _declare_qk_clip_rows(self, heads: int) -> None:
        """QK-clip's rows (``--qk-clip``, Megatron-Core's MLA clip): per head, the query's
        ``q_nope`` rows take ``eta ** alpha`` and its ``q_rope`` rows the whole ``eta`` (the
        rotary key is one for all heads, so it is not scaled); the key up-projection's
        ``k_nope`` rows take ``eta ** (1 - alpha)``, its value rows nothing."""
        mark_qk_clip_rows(self._query_weight(), ((self.qk_head_dim, "query"),
                                                 (self.pos_dim, "query_whole")), heads)
        mark_qk_clip_rows(self.linear_kv_up_proj.weight, ((self.qk_head_dim, "key"),
                                                          (self.v_head_dim, "none")), heads)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        b = x.shape[0]
        if self.q_layernorm is None:
            q, _ = self.linear_q_proj(x)
        else:
            q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        s = q.shape[1]  # the whole sequence under sp (the up-projection gathered it)
        q = q.view(b, s, self.num_heads, self.q_head_dim)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pos_dim],
                                                           dim=-1)
        latent = self.kv_layernorm(latent)
        # The rotary key enters the tp region (this rank's heads use it): gathered along the
        # sequence under sp, else copied; either way its gradient is summed over tp.
        if self.backend.sequence_parallel:
            k_rope = self.backend.gather_from_sequence_parallel(k_rope)
        elif self.parallel.tp_size > 1:
            k_rope = copy_to_tensor_parallel_region(k_rope, self.parallel.tp_group)
        k_rope = k_rope[:, :, None, :]
        q_nope, q_rope = q.split([self.qk_head_dim, self.pos_dim], dim=-1)
        if rotary is not None:
            q_rope = apply_rotary(q_rope, rotary, self.rotary_mscale, interleaved_pairs=True)
            k_rope = apply_rotary(k_rope, rotary, self.rotary_mscale, interleaved_pairs=True)
        inference = current_forward_context().inference
        if inference is not None:
            # Generation caches what the keys and values are made from, not them: the normed
            # latent and the rotated shared key (kv_lora_rank + qk_pos_emb_head_dim values a
            # token, the same on every tp rank), and rebuilds this rank's heads from the whole
            # cached prefix at every step.
            latent, k_rope = inference.update(self.cache_key, latent, k_rope)
        kv, _ = self.linear_kv_up_proj(latent)
        kv = kv.view(b, kv.shape[1], self.num_heads, self.qk_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.num_heads, -1)], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if self.qk_clip and self.training and inference is None:
            record_max_logits(self, (self._query_weight(), self.linear_kv_up_proj.weight),
                              layer_max_logits(q, k, self.parallel, self.window))
        context = (recompute(self.core_attention, q, k, v) if self.recompute_core
                   else self.core_attention(q, k, v))
        out, _ = self.linear_proj(context)
        return out


def mla_scales(config) -> tuple[float, float]:
    """``(rotary mscale, query scale)`` of MLA: both 1 unless the rope is YaRN's. Under YaRN
    cos and sin carry its attention factor (:func:`yarn_attention_factor`), and the softmax
    scale ``1/sqrt(qk + pos)`` is multiplied by ``mscale(factor, mscale_all_dim)^2``
    (Megatron-Core's MLA, DeepSeek's reference), here by scaling the queries."""
    scaling = rope_scaling(config)
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0, 1.0
    correction = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return yarn_attention_factor(scaling), correction * correction
