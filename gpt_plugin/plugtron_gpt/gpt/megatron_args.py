"""Megatron-Core's saved ``args`` <-> plugtron GPT flags: which args are plugtron flags of the
same name, which change the model (and the value under which plugtron computes the same), and
the translation of those whose forms differ (multi-latent attention, MTP, windows, rope
scaling). The tensors are megatron_convert.py's."""

from __future__ import annotations

from typing import Any

from plugtron.api import ConfigError
from plugtron_gpt.layers.attention_options import parse_window

#: Megatron's MLA args that are plugtron attention flags of the same name.
MLA_ARGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
            "rotary_scaling_factor", "mscale", "mscale_all_dim")
#: YaRN settings Megatron's MLA config fixes (MLATransformerConfig; no argument sets them).
MLA_YARN_CONSTANTS = {"yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
                      "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True}

#: Megatron args that are plugtron GPT model flags of the same name.
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "kv_channels", "seq_length", "max_position_embeddings", "vocab_size",
              "make_vocab_size_divisible_by", "position_embedding_type", "rotary_base",
              "normalization", "norm_epsilon", "swiglu", "untie_embeddings_and_output_weights",
              "add_bias_linear", "hidden_dropout", "attention_dropout", "init_method_std")
#: Megatron args that change the model, with the value under which plugtron's GPT computes the
#: same thing; another value is refused unless plugtron has a model option of that name (or a
#: translation in FROM_MEGATRON).
FEATURE_ARGS = {"use_legacy_models": False, "add_qkv_bias": False, "qk_layernorm": False,
                "qk_l2_norm": False, "openai_gelu": False, "squared_relu": False,
                "quick_geglu": False, "apply_layernorm_1p": False,
                "apply_residual_connection_post_layernorm": False,
                "rotary_percent": 1.0, "rotary_interleaved": False, "use_rope_scaling": False,
                "rotary_seq_len_interpolation_factor": None, "num_experts": None,
                "window_size": None, "window_attn_skip_freq": None, "no_rope_freq": None,
                "multi_latent_attention": False, "mtp_num_layers": None,
                "hybrid_override_pattern": None, "hybrid_layer_pattern": None,
                "softmax_type": "vanilla", "attention_output_gate": False,
                "glu_linear_offset": 0.0, "activation_func_clamp_value": None,
                "heterogeneous_layers_config_path": None}
#: Megatron-Core hard-codes these Llama 3.x rope scaling constants (only the factor is an arg:
#: rotary_pos_embedding.py's ``_apply_scaling``); plugtron's defaults are the same.
MEGATRON_ROPE_CONSTANTS = {"rope_scaling_low_freq_factor": 1.0,
                           "rope_scaling_high_freq_factor": 4.0,
                           "rope_scaling_original_max_position_embeddings": 8192}


def _qkv_bias(value, args, given, settings) -> dict:
    # Megatron sets add_qkv_bias whenever add_bias_linear is on (arguments.py): then it says
    # nothing more than add_bias_linear does.
    return {"add_qkv_bias": True} if value and not settings.get("add_bias_linear", True) else {}


def _openai_gelu(value, args, given, settings) -> dict:
    # Megatron-Core's GPTModel never reads --openai-gelu (only the removed legacy models did):
    # the saved flag trained exact GeLU, which is what plugtron computes without the option.
    # Given on the command line it is the user's choice.
    return {"openai_gelu": True} if value and "openai_gelu" in given else {}


def _window(value, args, given, settings) -> dict:
    if value is None:
        return {}
    text = ",".join(str(v) for v in value) if isinstance(value, (tuple, list)) else str(value)
    try:
        window = parse_window(text)
    except ConfigError as exc:
        raise ConfigError(f"the Megatron checkpoint was trained with window_size={value!r}, "
                          f"which plugtron cannot compute: {exc}") from None
    return {} if window is None else {"window_size": f"{window[0]},{window[1]}"}


def _rope_scaling(value, args, given, settings) -> dict:
    if not value:
        return {}
    factor = given.get("rope_scaling_factor", args.get("rope_scaling_factor", 8.0))
    return {"use_rope_scaling": True, "rope_scaling_factor": float(factor),
            **{k: given.get(k, v) for k, v in MEGATRON_ROPE_CONSTANTS.items()}}


def _mla_on(args, given) -> bool:
    return bool(given.get("multi_latent_attention", args.get("multi_latent_attention")))


def _qk_layernorm(value, args, given, settings) -> dict:
    # Under MLA Megatron's qk_layernorm means the latent norms (see _mla); else Qwen3's norms.
    return {"qk_layernorm": True} if value and not _mla_on(args, given) else {}


def _mla(value, args, given, settings) -> dict:
    if not value:
        return {}
    if not given.get("qk_layernorm", args.get("qk_layernorm", True)):
        raise ConfigError("the Megatron checkpoint was trained with multi_latent_attention and "
                          "qk_layernorm=False (no latent norms); plugtron's multi-latent "
                          "attention always normalises the q and kv latents")
    if args.get("mla_down_proj_fusion") or args.get("cache_mla_latents"):
        raise ConfigError("the Megatron checkpoint was trained with --mla-down-proj-fusion or "
                          "--cache-mla-latents (a fused linear_qkv_down_proj); plugtron maps "
                          "the separate down-projections only")
    out: dict[str, Any] = {"multi_latent_attention": True}
    out.update({k: args[k] for k in MLA_ARGS if args.get(k) is not None})
    out["q_lora_rank"] = args.get("q_lora_rank")  # None: no query compression
    # Megatron's MLA config takes YaRN when --rope-type is not given (MLATransformerConfig).
    rope = args.get("rope_type") or "yarn"
    out["rope_type"] = None if rope == "rope" else rope  # plugtron's default is plain rope
    if rope == "yarn":
        out.update({k: given.get(k, v) for k, v in MLA_YARN_CONSTANTS.items()})
    return {**out, **{k: given[k] for k in out if k in given}}


def _mtp(value, args, given, settings) -> dict:
    if not value:
        return {}
    if args.get("mtp_hybrid_override_pattern") or args.get("mtp_layer_pattern"):
        raise ConfigError("the Megatron checkpoint's MTP layers follow a hybrid pattern; "
                          "plugtron's GPT converter maps GPT MTP layers (transformer_layer)")
    out = {"mtp_num_layers": value}
    if args.get("mtp_loss_scaling_factor") is not None:
        out["mtp_loss_scaling_factor"] = args["mtp_loss_scaling_factor"]
    return out


#: The feature args this converter maps (with their tensors, where they have any); any other
#: is refused by name even where plugtron has an option of that name (num_experts: the MoE
#: model's experts are not this converter's).
MAPPED_FEATURES = ("add_qkv_bias", "qk_layernorm", "openai_gelu", "squared_relu", "window_size",
                   "use_rope_scaling", "rotary_seq_len_interpolation_factor",
                   "multi_latent_attention", "mtp_num_layers", "rotary_percent")
#: Megatron arg -> its plugtron settings, where the forms differ.
FROM_MEGATRON = {"add_qkv_bias": _qkv_bias, "openai_gelu": _openai_gelu, "window_size": _window,
                  "use_rope_scaling": _rope_scaling, "qk_layernorm": _qk_layernorm,
                  "multi_latent_attention": _mla, "mtp_num_layers": _mtp}
