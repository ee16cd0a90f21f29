"""Hugging Face <-> plugtron for the Hybrid model (entry point ``hybrid`` in
``plugtron.converters``).

* **Mamba2ForCausalLM** (``model_type: mamba2``): every layer a Mamba-2 mixer (pattern of M).
* **NemotronHForCausalLM** (``model_type: nemotron_h``): Megatron's hybrid layout, its
  ``hybrid_override_pattern`` symbols are plugtron's (``M``, ``*``, ``-``; ``E`` is refused here),
  attention without position embeddings, relu^2 non-gated MLPs (``--squared-relu``).

Both keep each layer's pre-norm at ``backbone.layers.{i}.norm`` and the mixer's tensors under the
names plugtron uses too (``mixer.in_proj``, ``mixer.conv1d``, ``mixer.A_log``, ``mixer.D``,
``mixer.dt_bias``, ``mixer.norm``, ``mixer.out_proj``), so Mamba layers map one to one. Both clamp
``softplus(dt)`` from below at ``time_step_limit[0]`` (``--mamba-dt-limit-min``); ``time_step_min``
only sets the initial range of dt. (transformers before 5.19 clamped NemotronH at
``time_step_min`` instead; export writes both, equal, whenever the clamp is on.)
"""

from __future__ import annotations

from plugtron.api import ConfigError
from plugtron_gpt.gpt.hf_convert import EMBEDDING, FINAL_NORM, OUTPUT, _take, fuse_qkv, split_qkv
from plugtron_gpt.hybrid.options import mamba_sizes
from plugtron_gpt.hybrid.pattern import layer_symbols
from plugtron_gpt.layers.attention_options import attention_options, parse_window
from plugtron_gpt.layers.mlp import squared_relu

MIXER_TENSORS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias",
                 "norm.weight", "out_proj.weight")
#: Where each layer type keeps its pre-norm in plugtron (HF: ``backbone.layers.{i}.norm``).
PRE_NORM = {"M": "norm", "*": "input_layernorm", "-": "pre_mlp_layernorm"}


def _check_mamba(c: dict, act_key: str) -> None:
    if c.get(act_key, "silu") != "silu":
        raise ConfigError(f"{act_key} {c[act_key]!r}: plugtron's Mamba mixer uses silu")
    if c.get("use_bias", False):
        raise ConfigError("use_bias=true (biases in the Mamba in_proj/out_proj) is not supported")
    if not c.get("use_conv_bias", True):
        raise ConfigError("use_conv_bias=false is not supported: plugtron's conv1d has a bias")
    if c.get("conv_kernel", 4) != 4:
        raise ConfigError(f"conv_kernel {c['conv_kernel']}: plugtron's conv1d has width 4")


def _common_flags(c: dict, pattern: str, heads: int, head_dim: int, state: int) -> dict:
    return {"num-layers": len(pattern), "hidden-size": c["hidden_size"],
            "vocab-size": c["vocab_size"], "normalization": "RMSNorm",
            "norm-epsilon": c.get("layer_norm_epsilon", 1e-5),
            "untie-embeddings-and-output-weights": not c.get("tie_word_embeddings", False),
            "hybrid-layer-pattern": pattern, "mamba-num-heads": heads,
            "mamba-head-dim": head_dim, "mamba-state-dim": state,
            "mamba-num-groups": c.get("n_groups", 8), "mamba-chunk-size": c.get("chunk_size", 128),
            "hidden-dropout": float(c.get("hidden_dropout", 0.0))}


def _import_tensors(c: dict, hf: dict, pattern: str, heads: int, groups: int) -> dict:
    out = {EMBEDDING: _take(hf, "backbone.embeddings.weight"),
           f"{FINAL_NORM}.weight": _take(hf, "backbone.norm_f.weight")}
    if not c.get("tie_word_embeddings", False):
        out[OUTPUT] = _take(hf, "lm_head.weight")
    for i, symbol in enumerate(pattern):
        src, dst = f"backbone.layers.{i}", f"decoder.layers.{i}"
        out[f"{dst}.{PRE_NORM[symbol]}.weight"] = _take(hf, f"{src}.norm.weight")
        kinds = ("weight", "bias") if c.get("attention_bias") else ("weight",)
        if symbol == "M":
            for name in MIXER_TENSORS:
                out[f"{dst}.mixer.{name}"] = _take(hf, f"{src}.mixer.{name}")
        elif symbol == "*":
            for kind in kinds:
                q, k, v = (_take(hf, f"{src}.mixer.{p}_proj.{kind}") for p in "qkv")
                out[f"{dst}.self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, heads, groups)
                out[f"{dst}.self_attention.linear_proj.{kind}"] = _take(
                    hf, f"{src}.mixer.o_proj.{kind}")
        else:
            for kind in kinds:
                out[f"{dst}.mlp.linear_fc1.{kind}"] = _take(hf, f"{src}.mixer.up_proj.{kind}")
                out[f"{dst}.mlp.linear_fc2.{kind}"] = _take(hf, f"{src}.mixer.down_proj.{kind}")
    return out


def _float(value) -> float:
    """A float of config.json; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def dt_limit_min(c: dict) -> float:
    """The lower clamp of ``softplus(dt)``: ``time_step_limit[0]``; an upper clamp is refused."""
    low, high = (_float(v) for v in c.get("time_step_limit", (0.0, float("inf"))))
    if high != float("inf"):
        raise ConfigError(f"time_step_limit {c['time_step_limit']}: only (low, inf) converts "
                          f"(plugtron clamps dt from below only, --mamba-dt-limit-min)")
    return low


def mamba2_from_hf(c: dict, hf: dict) -> tuple[dict, dict]:
    _check_mamba(c, "hidden_act")
    if dt_limit_min(c) != 0.0:
        raise ConfigError(f"time_step_limit {c['time_step_limit']}: only (0, inf) converts for "
                          f"Mamba2 (a clamped all-Mamba model exports as NemotronH)")
    pattern = "M" * c["num_hidden_layers"]
    flags = _common_flags(c, pattern, c["num_heads"], c["head_dim"], c["state_size"])
    return flags, _import_tensors(c, hf, pattern, 0, 0)


def nemotron_h_pattern(c: dict) -> str:
    pattern = c.get("hybrid_override_pattern")
    if pattern is None:
        names = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
        pattern = "".join(names[t] for t in c.get("layers_block_type") or c["layer_types"])
    if set(pattern) - set("M*-"):
        raise ConfigError(f"NemotronH pattern {pattern!r}: only M, * and - layers convert (E "
                          f"and multi-token prediction need their own converters)")
    return pattern


def nemotron_h_from_hf(c: dict, hf: dict) -> tuple[dict, dict]:
    _check_mamba(c, "mamba_hidden_act")
    if c.get("mlp_hidden_act", "relu2") != "relu2":
        raise ConfigError(f"mlp_hidden_act {c['mlp_hidden_act']!r}: only relu2 converts")
    bias = bool(c.get("attention_bias", False))
    if bool(c.get("mlp_bias", False)) != bias:
        raise ConfigError("attention_bias and mlp_bias differ; plugtron has one "
                          "--add-bias-linear for attention and MLP layers")
    pattern = nemotron_h_pattern(c)
    heads = c["num_attention_heads"]
    groups = c.get("num_key_value_heads") or heads
    flags = _common_flags(c, pattern, c["mamba_num_heads"], c["mamba_head_dim"],
                          c["ssm_state_size"])
    flags.update({"num-attention-heads": heads, "num-query-groups": groups,
                  "kv-channels": c.get("head_dim") or c["hidden_size"] // heads,
                  "ffn-hidden-size": c["intermediate_size"], "squared-relu": True,
                  "add-bias-linear": bias,
                  "attention-dropout": float(c.get("attention_dropout", 0.0)),
                  "mamba-dt-limit-min": dt_limit_min(c)})
    return flags, _import_tensors(c, hf, pattern, heads, groups)


def _export_tensors(m, config, t: dict, pattern: str) -> dict:
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    out = {"backbone.embeddings.weight": t[EMBEDDING],
           "backbone.norm_f.weight": t[f"{FINAL_NORM}.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = t[OUTPUT]
    kinds = ("weight", "bias") if m.add_bias_linear else ("weight",)
    for i, symbol in enumerate(pattern):
        src, dst = f"decoder.layers.{i}", f"backbone.layers.{i}"
        out[f"{dst}.norm.weight"] = t[f"{src}.{PRE_NORM[symbol]}.weight"]
        if symbol == "M":
            for name in MIXER_TENSORS:
                out[f"{dst}.mixer.{name}"] = t[f"{src}.mixer.{name}"]
        elif symbol == "*":
            for kind in kinds:
                q, k, v = split_qkv(t[f"{src}.self_attention.linear_qkv.{kind}"], heads, groups)
                for name, value in zip("qkv", (q, k, v)):
                    out[f"{dst}.mixer.{name}_proj.{kind}"] = value
                out[f"{dst}.mixer.o_proj.{kind}"] = t[f"{src}.self_attention.linear_proj.{kind}"]
        else:
            for kind in kinds:
                out[f"{dst}.mixer.up_proj.{kind}"] = t[f"{src}.mlp.linear_fc1.{kind}"]
                out[f"{dst}.mixer.down_proj.{kind}"] = t[f"{src}.mlp.linear_fc2.{kind}"]
    return out


def _exportable(m, config, pattern: str) -> None:
    if m.normalization != "RMSNorm":
        raise ConfigError("Mamba2 and NemotronH use RMSNorm; this model has "
                          f"--normalization {m.normalization}")
    if set(pattern) - set("M*-"):
        raise ConfigError(f"pattern {pattern!r}: only M, * and - layers export")
    if "*" in pattern and m.position_embedding_type == "rope":
        raise ConfigError("NemotronH attention has no position embeddings; this model uses rope")
    if "-" in pattern and not squared_relu(config):
        raise ConfigError("NemotronH MLPs are relu^2: export needs --squared-relu")
    options = attention_options(config)
    for flag, on in (("--qk-layernorm", options.qk_layernorm),
                     ("--add-qkv-bias", options.add_qkv_bias and not m.add_bias_linear),
                     ("--window-size", parse_window(options.window_size) is not None)):
        if on and "*" in pattern:
            raise ConfigError(f"NemotronH attention has no {flag}; this model cannot be "
                              f"exported as NemotronH")


def hybrid_to_hf(m, config) -> dict:
    o = config.hybrid
    pattern = layer_symbols(o.layer_pattern)
    size = mamba_sizes(config)
    common = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
              "num_hidden_layers": len(pattern), "layer_norm_epsilon": m.norm_epsilon,
              "n_groups": size["groups"], "conv_kernel": 4, "use_bias": False,
              "use_conv_bias": True, "chunk_size": o.chunk_size,
              "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
              "residual_in_fp32": False}
    if set(pattern) == {"M"} and o.dt_limit_min == 0:
        if size["inner"] % m.hidden_size:
            raise ConfigError(f"Mamba2 needs heads x head dim ({size['inner']}) a multiple of "
                              f"--hidden-size {m.hidden_size} (its expand factor)")
        return {**common, "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
                "num_heads": size["heads"], "head_dim": size["head_dim"],
                "state_size": size["state"], "expand": size["inner"] // m.hidden_size,
                "hidden_act": "silu"}
    heads = m.num_attention_heads
    return {**common, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "hybrid_override_pattern": pattern, "num_attention_heads": heads,
            "num_key_value_heads": m.num_query_groups or heads,
            "head_dim": m.kv_channels or m.hidden_size // heads,
            "intermediate_size": m.ffn_hidden_size or 4 * m.hidden_size,
            "mlp_hidden_act": "relu2", "attention_bias": m.add_bias_linear,
            "mlp_bias": m.add_bias_linear, "attention_dropout": m.attention_dropout,
            "ssm_state_size": size["state"], "mamba_num_heads": size["heads"],
            "mamba_head_dim": size["head_dim"], "mamba_hidden_act": "silu",
            "time_step_min": o.dt_limit_min or 0.001,
            "time_step_limit": [o.dt_limit_min, float("inf")], "hidden_dropout": m.hidden_dropout}


class HybridConverter:
    #: what ``plugtron convert import-hf`` finds this converter by (config.json's model_type)
    model_types = ("mamba2", "nemotron_h")
    vocab_tensors = (EMBEDDING, OUTPUT)

    def import_hf(self, hf_config: dict, tensors: dict) -> tuple[dict, dict]:
        kind = hf_config.get("model_type")
        if kind == "mamba2":
            return mamba2_from_hf(hf_config, tensors)
        if kind == "nemotron_h":
            return nemotron_h_from_hf(hf_config, tensors)
        raise ConfigError(f"Hugging Face model_type {kind!r} is not supported; the hybrid "
                          f"converter reads 'mamba2' and 'nemotron_h'")

    def export_hf(self, model_config, tensors: dict, config=None) -> tuple[dict, dict]:
        if config is None:
            raise ConfigError("the hybrid converter needs the whole config (its pattern)")
        pattern = layer_symbols(config.hybrid.layer_pattern)
        _exportable(model_config, config, pattern)
        hf_config = hybrid_to_hf(model_config, config)
        return hf_config, _export_tensors(model_config, config, tensors, pattern)
