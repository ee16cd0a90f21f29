"""Hugging Face DeepSeek-V3 (``model_type: deepseek_v3``: DeepSeek-V3/R1 and others) <->
plugtron's GPT model with multi-latent attention, MoE and multi-token prediction (entry point
``deepseek_v3`` in ``plugtron.converters``).

What each config.json field becomes:

=========================================  ===============================================
``q_lora_rank`` (null: no compression)     ``--q-lora-rank`` (unset)
``kv_lora_rank``, ``qk_nope_head_dim``,    ``--kv-lora-rank``, ``--qk-head-dim``,
``qk_rope_head_dim``, ``v_head_dim``       ``--qk-pos-emb-head-dim``, ``--v-head-dim``
``first_k_dense_replace`` k                ``--moe-layer-freq [0]*k+[1]*(L-k)`` (the dense
                                           layers' MLP: ``intermediate_size``)
``n_routed_experts``, ``num_experts_per    ``--num-experts``, ``--moe-router-topk``,
_tok``, ``moe_intermediate_size``          ``--moe-ffn-hidden-size``
``n_shared_experts`` n                     ``--moe-shared-expert-intermediate-size n x moe``
sigmoid scores + ``e_score_correction_     ``--moe-router-score-function sigmoid
bias``, normalised top-k                   --moe-router-enable-expert-bias`` (the bias is
                                           ``mlp.router.expert_bias``), router in fp32
``n_group``, ``topk_group``                ``--moe-router-num-groups``,
                                           ``--moe-router-group-topk``
``routed_scaling_factor``                  ``--moe-router-topk-scaling-factor``
``num_nextn_predict_layers`` D             ``--mtp-num-layers D`` when the files hold them
``rope_parameters`` / ``rope_scaling``     ``--rotary-base``, YaRN flags (hf_rope.py)
=========================================  ===============================================

The multi-token prediction layers are stored as extra decoder layers
``model.layers.{L + k}`` holding a decoder layer (MLA + MoE, as every DeepSeek-V3 MTP block)
plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (plugtron's
``mtp.layers.{k}.final_layernorm``) and copies of the embedding (``embed_tokens``) and output
layer (``shared_head.head``), which plugtron shares with the model: they must equal the model's
own. transformers' ``DeepseekV3ForCausalLM`` does not run them (its ``MtpModel`` does, for
speculative decoding); its ``save_pretrained`` leaves them out while config.json still says
``num_nextn_predict_layers: 1``, so the depth is the number of MTP layers the files hold.

Refused, naming the field: anything the model could compute differently (the lists below),
quantised weights, and any field this converter does not know.
"""

from __future__ import annotations

import sys

import torch
from plugtron.api import ConfigError, selected_driver

from .hf_convert import EMBEDDING, OUTPUT, _take, fused_experts
from .hf_rope import rope_config, rope_flags
from .megatron_convert import MegatronMoE
from .options import moe_layer_pattern, uses_sinkhorn

#: plugtron's MLA names under ``self_attention`` -> transformers' under ``self_attn``.
MLA_NAMES = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj",
             "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj",
             "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
             "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
#: plugtron's MTP depth names -> the extra HF layer's.
MTP_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
             "final_layernorm": "shared_head.norm"}

#: transformers' DeepseekV3RMSNorm of the q and kv latents keeps its default eps whatever
#: ``rms_norm_eps`` says (as DeepSeek's reference code); plugtron has one --norm-epsilon.
LATENT_NORM_EPS = 1e-6

#: Fields that map onto the model (read below).
MAPPED = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
    "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim",
    "head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
    "norm_topk_prob", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "rope_interleave",
    "attention_bias", "attention_dropout", "num_nextn_predict_layers", "num_mtp_layers",
    "bos_token_id", "eos_token_id", "pad_token_id", "original_max_position_embeddings",
    "partial_rotary_factor",
    # DeepSeek's own config.json (trust_remote_code): checked below
    "scoring_func", "topk_method", "moe_layer_freq", "quantization_config"}
#: Fields that do not change what the weights compute (training, generation and bookkeeping
#: settings transformers and DeepSeek write).
IGNORED = {"dtype", "torch_dtype", "transformers_version", "initializer_range", "use_cache",
           "output_router_logits", "router_aux_loss_coef", "pretraining_tp", "auto_map",
           "ep_size", "aux_loss_alpha", "seq_aux", "output_hidden_states",
           "output_attentions", "return_dict", "use_return_dict", "tokenizer_class",
           "is_decoder", "is_encoder_decoder", "add_cross_attention", "chunk_size_feed_forward",
           "id2label", "label2id", "problem_type", "finetuning_task", "tie_encoder_decoder",
           "torchscript", "use_bfloat16", "pruned_heads", "task_specific_params", "prefix",
           "sep_token_id", "decoder_start_token_id"}


def _layer(i: int) -> str:
    return f"decoder.layers.{i}"


def _mtp(k: int) -> str:
    return f"mtp.layers.{k}"


def dense_layers(c: dict) -> int:
    """``first_k_dense_replace`` (transformers: layer i is MoE when ``i >= k``)."""
    k = c.get("first_k_dense_replace")
    k = 0 if k is None else k
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ConfigError(f"config.json first_k_dense_replace must be a non-negative integer, "
                          f"got {k!r}")
    return min(k, c["num_hidden_layers"])


def check_fields(c: dict) -> None:
    """Refuse what plugtron's model would compute differently, and unknown fields."""
    unknown = sorted(k for k in c if k not in MAPPED and k not in IGNORED
                     and not k.startswith("_"))
    if unknown:
        raise ConfigError(f"deepseek_v3 config.json field(s) {', '.join(unknown)} are unknown "
                          f"to plugtron's converter, which cannot tell whether they change "
                          f"what the model computes; remove them if they do not")
    if c.get("quantization_config"):
        method = (c["quantization_config"] or {}).get("quant_method", "?")
        raise ConfigError(f"config.json quantization_config ({method}): quantised weights are "
                          f"not read; convert a dequantised (bf16/fp32) copy")
    checks = [
        (c.get("hidden_act", "silu") != "silu", "hidden_act must be silu (SwiGLU)"),
        (c.get("attention_bias", False), "attention_bias=true: plugtron's multi-latent "
                                          "attention has no bias on its projections"),
        (c.get("rope_interleave", True) is not True,
         "rope_interleave=false: plugtron's multi-latent attention turns interleaved channel "
         "pairs (DeepSeek's layout)"),
        (c.get("scoring_func", "sigmoid") != "sigmoid",
         f"scoring_func {c.get('scoring_func')!r}: DeepSeek-V3 routes by sigmoid scores"),
        (c.get("topk_method", "noaux_tc") != "noaux_tc",
         f"topk_method {c.get('topk_method')!r}: transformers' DeepSeek-V3 routes with the "
         f"corrected scores (noaux_tc)"),
        (c.get("moe_layer_freq", 1) != 1,
         f"moe_layer_freq {c.get('moe_layer_freq')!r}: transformers' DeepSeek-V3 makes every "
         f"layer from first_k_dense_replace on MoE"),
        (c.get("rms_norm_eps", 1e-6) != LATENT_NORM_EPS,
         f"rms_norm_eps {c.get('rms_norm_eps')}: transformers normalises the q and kv latents "
         f"with eps {LATENT_NORM_EPS} whatever rms_norm_eps says, and plugtron has one "
         f"--norm-epsilon for every norm"),
    ]
    for bad, why in checks:
        if bad:
            raise ConfigError(f"deepseek_v3 {why}")
    heads, groups = c["num_attention_heads"], c.get("num_key_value_heads")
    if groups is not None and groups != heads:
        raise ConfigError(f"deepseek_v3 num_key_value_heads {groups} != num_attention_heads "
                          f"{heads}: multi-latent attention expands keys and values for every "
                          f"head")
    rope, nope = c["qk_rope_head_dim"], c["qk_nope_head_dim"]
    for key, want in (("qk_head_dim", rope + nope), ("head_dim", rope)):
        if c.get(key) is not None and c[key] != want:
            raise ConfigError(f"deepseek_v3 {key} {c[key]} disagrees with qk_nope_head_dim "
                              f"{nope} and qk_rope_head_dim {rope} (expected {want})")


def router_flags(c: dict) -> dict:
    """Sigmoid top-k with expert bias, groups and scaling, where plugtron computes the same."""
    experts, topk = c["n_routed_experts"], c["num_experts_per_tok"]
    norm = c.get("norm_topk_prob", True)
    if topk > 1 and not norm:
        raise ConfigError("deepseek_v3 norm_topk_prob=false with num_experts_per_tok > 1: "
                          "plugtron's sigmoid routing always renormalises the top-k weights "
                          "(Megatron's)")
    if topk == 1 and norm:
        raise ConfigError("deepseek_v3 norm_topk_prob=true with num_experts_per_tok 1 gives "
                          "every token the weight 1, which plugtron's sigmoid routing does not "
                          "(it keeps the score)")
    flags = {"moe-router-score-function": "sigmoid", "moe-router-enable-expert-bias": True,
             "moe-router-topk-scaling-factor": float(c.get("routed_scaling_factor", 1.0)),
             "moe-router-dtype": "fp32"}  # transformers keeps the gate in fp32
    groups, group_topk = c.get("n_group") or 1, c.get("topk_group") or 1
    if experts % groups or experts // groups < 2:
        raise ConfigError(f"deepseek_v3 n_routed_experts {experts} must split into n_group "
                          f"{groups} groups of at least 2 experts")
    if group_topk < groups:
        # transformers scores a group by its best 2 experts; Megatron's (plugtron's) group
        # score is the sum of its best topk / topk_group.
        if topk % group_topk or topk // group_topk != 2:
            raise ConfigError(f"deepseek_v3 topk_group {group_topk} with num_experts_per_tok "
                              f"{topk}: transformers scores a group by the sum of its best 2 "
                              f"experts, plugtron by its best topk/topk_group "
                              f"({topk}/{group_topk}); they agree only when that is 2")
        flags.update({"moe-router-num-groups": groups, "moe-router-group-topk": group_topk})
    elif group_topk > groups:
        raise ConfigError(f"deepseek_v3 topk_group {group_topk} is more than n_group {groups}")
    return flags


class DeepseekV3Converter(MegatronMoE):
    """Reads and writes ``deepseek_v3``; the checkpoint runs on the ``gpt`` model."""

    model = "gpt"
    model_types = ("deepseek_v3",)
    vocab_tensors = (EMBEDDING, OUTPUT)

    @classmethod
    def handles(cls, config) -> bool:
        moe = getattr(config, "moe", None)
        return (selected_driver(config, "model") == "gpt" and bool(moe and moe.num_experts)
                and bool(getattr(getattr(config, "attention", None), "multi_latent_attention",
                                 False)))

    # ------------------------------------------------------------------ import

    def import_hf(self, c: dict, hf) -> tuple[dict, dict]:
        if c.get("model_type") != "deepseek_v3":
            raise ConfigError(f"model_type {c.get('model_type')!r}: this converter reads "
                              f"deepseek_v3")
        check_fields(c)
        layers, hidden = c["num_hidden_layers"], c["hidden_size"]
        experts, shared = c["n_routed_experts"], c.get("n_shared_experts", 1)
        if not isinstance(shared, int) or shared < 1:
            raise ConfigError(f"deepseek_v3 n_shared_experts {shared!r}: plugtron reads "
                              f"DeepSeek-V3 with at least one shared expert")
        dense = dense_layers(c)
        sparse = [i >= dense for i in range(layers)]
        tied = bool(c.get("tie_word_embeddings", False))
        depth = self._mtp_depth(c, hf, layers)
        if depth and not sparse[-1]:
            raise ConfigError("deepseek_v3 with multi-token prediction layers but no MoE layer: "
                              "DeepSeek-V3's MTP block is an MoE layer, plugtron's is of the "
                              "kind of the model's last layer (dense here)")
        flags = {"num-layers": layers, "hidden-size": hidden,
                 "ffn-hidden-size": c["intermediate_size"],
                 "num-attention-heads": c["num_attention_heads"],
                 "vocab-size": c["vocab_size"], "position-embedding-type": "rope",
                 "normalization": "RMSNorm", "norm-epsilon": c.get("rms_norm_eps", 1e-6),
                 "swiglu": True, "untie-embeddings-and-output-weights": not tied,
                 "add-bias-linear": False, "hidden-dropout": 0.0,
                 "attention-dropout": float(c.get("attention_dropout", 0.0)),
                 "multi-latent-attention": True, "kv-lora-rank": c["kv_lora_rank"],
                 "qk-head-dim": c["qk_nope_head_dim"],
                 "qk-pos-emb-head-dim": c["qk_rope_head_dim"], "v-head-dim": c["v_head_dim"],
                 "num-experts": experts, "moe-router-topk": c["num_experts_per_tok"],
                 "moe-ffn-hidden-size": c["moe_intermediate_size"],
                 "moe-shared-expert-intermediate-size": shared * c["moe_intermediate_size"],
                 "moe-layer-freq": "[" + ",".join(str(int(s)) for s in sparse) + "]",
                 "moe-aux-loss-coeff": 0.0}
        flags |= router_flags(c) | rope_flags(c, mla=True)
        if c.get("q_lora_rank") is not None:
            flags["q-lora-rank"] = c["q_lora_rank"]
        if depth:
            flags["mtp-num-layers"] = depth
        if c.get("max_position_embeddings"):
            flags["max-position-embeddings"] = c["max_position_embeddings"]
        out = {EMBEDDING: _take(hf, "model.embed_tokens.weight"),
               "decoder.final_layernorm.weight": _take(hf, "model.norm.weight")}
        if not tied:
            out[OUTPUT] = _take(hf, "lm_head.weight")
        for i in range(layers):
            out.update(self._layer_from_hf(hf, f"model.layers.{i}", _layer(i), sparse[i],
                                           experts))
        for k in range(depth):
            src, dst = f"model.layers.{layers + k}", _mtp(k)
            for ours, theirs in MTP_NAMES.items():
                out[f"{dst}.{ours}.weight"] = _take(hf, f"{src}.{theirs}.weight")
            self._check_copy(hf, f"{src}.embed_tokens.weight", out[EMBEDDING], "embedding")
            self._check_copy(hf, f"{src}.shared_head.head.weight",
                             out[EMBEDDING] if tied else out[OUTPUT], "output layer")
            out.update(self._layer_from_hf(hf, src, f"{dst}.mtp_model_layer", True, experts))
        return flags, out

    @staticmethod
    def _mtp_depth(c: dict, hf, layers: int) -> int:
        said = c.get("num_nextn_predict_layers", c.get("num_mtp_layers")) or 0
        held = 0
        while f"model.layers.{layers + held}.eh_proj.weight" in hf:
            held += 1
        if said and not held:
            print(f"note: config.json says num_nextn_predict_layers {said}, but the weight "
                  f"files hold no multi-token prediction layer (transformers' save_pretrained "
                  f"leaves them out): imported without MTP", file=sys.stderr)
        elif held != said:
            raise ConfigError(f"deepseek_v3 num_nextn_predict_layers {said}, but the weight "
                              f"files hold {held} multi-token prediction layer(s) "
                              f"(model.layers.{layers}...)")
        return held

    @staticmethod
    def _check_copy(hf, name: str, ours: torch.Tensor, what: str) -> None:
        """An MTP layer's copy of the embedding or output layer: plugtron shares the model's,
        so it must be equal (absent is fine)."""
        if name in hf and not torch.equal(hf[name], ours):
            raise ConfigError(f"{name} differs from the model's {what}: plugtron's multi-token "
                              f"prediction shares the model's {what}")

    @staticmethod
    def _layer_from_hf(hf, src: str, dst: str, sparse: bool, experts: int) -> dict:
        out = {f"{dst}.input_layernorm.weight": _take(hf, f"{src}.input_layernorm.weight"),
               f"{dst}.pre_mlp_layernorm.weight": _take(hf,
                                                        f"{src}.post_attention_layernorm.weight")}
        for ours, theirs in MLA_NAMES.items():
            name = f"{src}.self_attn.{theirs}.weight"
            if name in hf:  # q_proj or q_a/q_b: config.json's q_lora_rank says which
                out[f"{dst}.self_attention.{ours}.weight"] = hf[name]
        m = f"{dst}.mlp"

        def mlp(prefix: str, hf_prefix: str) -> None:
            out[f"{prefix}.linear_fc1.weight"] = torch.cat(
                [_take(hf, f"{hf_prefix}.gate_proj.weight"),
                 _take(hf, f"{hf_prefix}.up_proj.weight")])
            out[f"{prefix}.linear_fc2.weight"] = _take(hf, f"{hf_prefix}.down_proj.weight")

        if not sparse:
            mlp(m, f"{src}.mlp")
            return out
        router, gate_up, down = fused_experts(hf, src, experts)
        out[f"{m}.router.weight"] = router
        out[f"{m}.router.expert_bias"] = _take(hf, f"{src}.mlp.gate.e_score_correction_bias")
        for e in range(experts):
            prefix = f"{m}.experts.local_experts.{e}"
            out[f"{prefix}.linear_fc1.weight"] = gate_up[e]
            out[f"{prefix}.linear_fc2.weight"] = down[e]
        mlp(f"{m}.shared_experts", f"{src}.mlp.shared_experts")
        return out

    # ------------------------------------------------------------------ export

    def export_hf(self, model_config, tensors):
        raise ConfigError("the deepseek_v3 converter needs the run config: use export_hf_from")

    def export_hf_from(self, config, t) -> tuple[dict, dict]:
        m, o = config.model, config.moe
        a = config.attention
        layers = m.num_layers
        sparse = moe_layer_pattern(o.moe_layer_freq, layers)
        dense = sparse.index(True) if any(sparse) else layers
        moe_ffn = o.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
        shared = o.moe_shared_expert_intermediate_size or 0
        depth = getattr(getattr(config, "mtp", None), "mtp_num_layers", None) or 0
        groups, group_topk = o.moe_router_num_groups, o.moe_router_group_topk
        checks = [
            (not (m.normalization == "RMSNorm" and m.swiglu
                  and m.position_embedding_type == "rope"),
             "DeepSeek-V3 has RMSNorm, --swiglu and rope"),
            (m.add_bias_linear, "DeepSeek-V3 has no biases (--disable-bias-linear)"),
            (m.norm_epsilon != LATENT_NORM_EPS,
             f"--norm-epsilon {m.norm_epsilon}: transformers normalises the q and kv latents "
             f"with eps {LATENT_NORM_EPS} whatever rms_norm_eps says; export a model trained "
             f"with --norm-epsilon {LATENT_NORM_EPS}"),
            (sparse != [i >= dense for i in range(layers)],
             f"--moe-layer-freq {o.moe_layer_freq}: DeepSeek-V3 has dense layers first, then "
             f"MoE (first_k_dense_replace)"),
            (o.moe_router_score_function != "sigmoid" or uses_sinkhorn(o),
             "DeepSeek-V3 routes by sigmoid scores (--moe-router-score-function sigmoid)"),
            (shared < 1 or shared % moe_ffn,
             f"DeepSeek-V3 has n_shared_experts shared experts of --moe-ffn-hidden-size "
             f"{moe_ffn} each: --moe-shared-expert-intermediate-size must be a positive "
             f"multiple of it, got {shared or None}"),
            (o.moe_shared_expert_gate, "DeepSeek-V3's shared experts have no gate "
                                        "(--moe-shared-expert-gate)"),
            (bool(group_topk) and group_topk < (groups or 1)
             and o.moe_router_topk != 2 * group_topk,
             f"--moe-router-group-topk {group_topk} with --moe-router-topk "
             f"{o.moe_router_topk}: transformers scores a group by its best 2 experts, "
             f"plugtron by its best topk/group-topk"),
            (depth and not sparse[-1], "DeepSeek-V3's multi-token prediction block is an MoE "
                                       "layer; this model's last layer (and so its MTP "
                                       "block) is dense"),
            (getattr(a, "window_size", None) not in (None, ""),
             "DeepSeek-V3 has no sliding window (--window-size)"),
        ]
        for bad, why in checks:
            if bad:
                raise ConfigError(f"deepseek_v3 export: {why}")
        topk = o.moe_router_topk
        hf_config = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
            "intermediate_size": m.ffn_hidden_size or 4 * m.hidden_size,
            "moe_intermediate_size": moe_ffn, "num_hidden_layers": layers,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_attention_heads,
            "n_shared_experts": shared // moe_ffn, "n_routed_experts": o.num_experts,
            "routed_scaling_factor": float(o.moe_router_topk_scaling_factor or 1.0),
            "kv_lora_rank": a.kv_lora_rank, "q_lora_rank": a.q_lora_rank,
            "qk_rope_head_dim": a.qk_pos_emb_head_dim, "v_head_dim": a.v_head_dim,
            "qk_nope_head_dim": a.qk_head_dim, "n_group": groups or 1,
            "topk_group": group_topk or groups or 1, "num_experts_per_tok": topk,
            "first_k_dense_replace": dense, "norm_topk_prob": topk > 1, "hidden_act": "silu",
            "max_position_embeddings": m.max_position_embeddings or m.seq_length,
            "rms_norm_eps": m.norm_epsilon,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
            "rope_interleave": True, "attention_bias": False,
            "attention_dropout": m.attention_dropout, "num_nextn_predict_layers": depth,
            **rope_config(config)}
        tied = not m.untie_embeddings_and_output_weights
        out = {"model.embed_tokens.weight": t[EMBEDDING],
               "model.norm.weight": t["decoder.final_layernorm.weight"]}
        if not tied:
            out["lm_head.weight"] = t[OUTPUT]
        for i in range(layers):
            out.update(self._layer_to_hf(t, _layer(i), f"model.layers.{i}", sparse[i],
                                         o.num_experts))
        for k in range(depth):
            src, dst = _mtp(k), f"model.layers.{layers + k}"
            for ours, theirs in MTP_NAMES.items():
                out[f"{dst}.{theirs}.weight"] = t[f"{src}.{ours}.weight"]
            # DeepSeek's files keep the MTP layer's own copies (vLLM and SGLang read them)
            out[f"{dst}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
            out[f"{dst}.shared_head.head.weight"] = t[EMBEDDING if tied else OUTPUT].clone()
            out.update(self._layer_to_hf(t, f"{src}.mtp_model_layer", dst, True,
                                         o.num_experts))
        return hf_config, out

    @staticmethod
    def _layer_to_hf(t, src: str, dst: str, sparse: bool, experts: int) -> dict:
        out = {f"{dst}.input_layernorm.weight": t[f"{src}.input_layernorm.weight"],
               f"{dst}.post_attention_layernorm.weight": t[f"{src}.pre_mlp_layernorm.weight"]}
        for ours, theirs in MLA_NAMES.items():
            name = f"{src}.self_attention.{ours}.weight"
            if name in t:
                out[f"{dst}.self_attn.{theirs}.weight"] = t[name]
        m = f"{src}.mlp"

        def mlp(prefix: str, hf_prefix: str) -> None:
            gate, up = t[f"{prefix}.linear_fc1.weight"].chunk(2)
            out[f"{hf_prefix}.gate_proj.weight"], out[f"{hf_prefix}.up_proj.weight"] = gate, up
            out[f"{hf_prefix}.down_proj.weight"] = t[f"{prefix}.linear_fc2.weight"]

        if not sparse:
            mlp(m, f"{dst}.mlp")
            return out
        out[f"{dst}.mlp.gate.weight"] = t[f"{m}.router.weight"]
        bias = f"{m}.router.expert_bias"
        out[f"{dst}.mlp.gate.e_score_correction_bias"] = (
            t[bias] if bias in t else torch.zeros(experts, dtype=torch.float32))
        per = [f"{m}.experts.local_experts.{e}" for e in range(experts)]
        out[f"{dst}.mlp.experts.gate_up_proj"] = torch.stack([t[f"{p}.linear_fc1.weight"]
                                                              for p in per])
        out[f"{dst}.mlp.experts.down_proj"] = torch.stack([t[f"{p}.linear_fc2.weight"]
                                                           for p in per])
        mlp(f"{m}.shared_experts", f"{dst}.mlp.shared_experts")
        return out
