"""The Llama family of Hugging Face layouts (``llama``, ``mistral``, ``qwen2``, ``qwen3``): how
their config.json fields map to plugtron flags and back. The tensors are the same for all four
(hf_convert.py), plus Qwen3's per-head ``q_norm`` / ``k_norm``.

=========  ===========================================================================
family     what differs from Llama
=========  ===========================================================================
mistral    ``sliding_window`` W (every layer): ``--window-size W-1,0``; no biases
qwen2      biases on q, k, v only: ``--add-qkv-bias``; sliding window per ``layer_types``
qwen3      ``q_norm`` / ``k_norm`` per head: ``--qk-layernorm``; ``attention_bias`` on q/k/v/o
=========  ===========================================================================

Rotary scaling (``rope_parameters``, or the older ``rope_scaling``): ``default``, ``linear``
(``--rotary-seq-len-interpolation-factor``), ``llama3`` (``--use-rope-scaling`` and its four
options) and ``yarn`` (``--rope-type yarn`` and its options, :func:`yarn_flags`) convert
exactly; any other type (``dynamic``, ``longrope``, ...) is refused naming it, since plugtron
would compute different angles.
"""

from __future__ import annotations

import math

from plugtron.api import ConfigError, yarn_attention_factor, yarn_mscale
from plugtron_gpt.layers.attention_options import attention_options, parse_window, rope_scaling

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _need(d: dict, key: str, where: str):
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json {where} has no {key!r}")
    return d[key]


# --------------------------------------------------------------------------- import


def rope_flags(c: dict, mla: bool = False) -> dict:
    """``rotary-base`` and the scaling flags of ``c``'s rotary settings (``mla``: for
    multi-latent attention, where ``--mscale-all-dim`` also sets the softmax correction).
    Shared with the converters of models that extend gpt (``GPTConverter.hf_rope_flags``)."""
    params = dict(c.get("rope_scaling") or {})
    params.update(c.get("rope_parameters") or {})  # transformers 5's name wins
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported: plugtron rotates every "
                          "channel of a head")
    flags = {"rotary-base": theta}
    if kind == "default":
        return flags
    where = "rope_parameters"
    if kind == "linear":
        flags["rotary-seq-len-interpolation-factor"] = float(_need(params, "factor", where))
        return flags
    if kind == "llama3":
        original = params.get("original_max_position_embeddings") or c.get(
            "max_position_embeddings")
        if original is None:
            raise ConfigError("config.json rope_parameters (llama3) has no "
                              "'original_max_position_embeddings'")
        flags.update({"use-rope-scaling": True,
                      "rope-scaling-factor": float(_need(params, "factor", where)),
                      "rope-scaling-low-freq-factor": float(_need(params, "low_freq_factor",
                                                                  where)),
                      "rope-scaling-high-freq-factor": float(_need(params, "high_freq_factor",
                                                                   where)),
                      "rope-scaling-original-max-position-embeddings": int(original)})
        return flags
    if kind == "yarn":
        return flags | yarn_flags(params, c, mla)
    raise ConfigError(f"rope type {kind!r} is not supported by plugtron: it converts 'default', "
                      f"'linear', 'llama3' and 'yarn' rotary scaling exactly; {kind!r} would "
                      f"compute different angles")


def yarn_flags(params: dict, c: dict, mla: bool = False) -> dict:
    """``--rope-type yarn`` and its options, computing what transformers computes: ``factor``
    required; ``original_max_position_embeddings`` from the top level, else the rope
    parameters, else ``max_position_embeddings``; cos and sin scaled by ``attention_factor``
    where given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` only when both
    are set, else ``mscale(factor)`` (a config whose value --mscale / --mscale-all-dim cannot
    give is refused); ``beta_fast`` / ``beta_slow`` 32 / 1 and ``truncate`` true by default.
    Under MLA ``mscale_all_dim`` is kept whatever the rest: it also scales the softmax (as
    DeepSeek's ``mscale_all_dim`` does in transformers)."""
    factor = params.get("factor")
    if factor is None:
        raise ConfigError("config.json rope_parameters (yarn) has no 'factor'")
    factor = float(factor)
    original = (c.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or c.get("max_position_embeddings"))
    if original is None:
        raise ConfigError("config.json rope_parameters (yarn) has no "
                          "'original_max_position_embeddings'")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and all_dim)
    given = params.get("attention_factor")
    # Without attention_factor transformers ignores mscale unless mscale_all_dim is set too;
    # with it (plugtron's export writes one then), the file's values are taken as they are.
    literal = given is not None or both
    ours = (float(1.0 if mscale is None else mscale) if literal else 1.0,
            float(all_dim or 0.0) if literal or mla else 0.0)
    computed = yarn_mscale(factor, ours[0]) / yarn_mscale(factor, ours[1])
    theirs = float(given) if given is not None else computed if both else yarn_mscale(factor)
    if not math.isclose(theirs, computed, rel_tol=1e-12):
        raise ConfigError(
            f"rope_parameters (yarn): transformers scales cos and sin by {theirs} (factor "
            f"{factor}, mscale {mscale}, mscale_all_dim {all_dim}, attention_factor {given}), "
            f"but plugtron's --mscale / --mscale-all-dim give {computed}"
            + (" (with multi-latent attention --mscale-all-dim also sets the softmax "
               "correction, so it must be mscale_all_dim)" if mla and all_dim else "")
            + "; no flag value gives both")
    return {"rope-type": "yarn", "rotary-scaling-factor": factor,
            "yarn-original-max-position-embeddings": int(original),
            "mscale": ours[0], "mscale-all-dim": ours[1],
            "yarn-beta-fast": float(params.get("beta_fast") or 32),
            "yarn-beta-slow": float(params.get("beta_slow") or 1),
            "yarn-correction-range-round-to-int": bool(params.get("truncate", True))}


def window_flags(c: dict, family: str) -> dict:
    """``window-size`` where every layer uses the same sliding window; ConfigError where layers
    differ (plugtron's window applies to every attention layer)."""
    window = c.get("sliding_window")
    if family == "mistral":
        sliding = [window is not None] * c["num_hidden_layers"]
    elif family in ("qwen2", "qwen3"):
        types = c.get("layer_types")
        if types is None:
            on = bool(c.get("use_sliding_window")) and window is not None
            first = c.get("max_window_layers", 0)
            sliding = [on and i >= first for i in range(c["num_hidden_layers"])]
        else:
            sliding = [kind == "sliding_attention" for kind in types]
    else:
        if window is not None or c.get("use_sliding_window"):
            raise ConfigError(f"{family} with a sliding window is not a layout plugtron reads")
        return {}
    if not any(sliding):
        return {}
    if not all(sliding):
        raise ConfigError(f"{family}: some layers use sliding-window attention and some full "
                          f"(layer_types / max_window_layers); plugtron's --window-size applies "
                          f"to every layer")
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json sliding_window must be a positive integer, got "
                          f"{window!r}")
    # Hugging Face's window of W keys includes the query's own position: Megatron's left W-1.
    return {"window-size": f"{window - 1},0"}


def bias_flags(c: dict, family: str) -> dict:
    """``add-bias-linear`` / ``add-qkv-bias`` from the family's bias fields."""
    if family == "qwen2":
        return {"add-bias-linear": False, "add-qkv-bias": True}
    if family == "mistral":
        return {"add-bias-linear": False}
    attention = bool(c.get("attention_bias", False))
    mlp = bool(c.get("mlp_bias", False))
    if family == "qwen3" and attention:
        raise ConfigError("qwen3 attention_bias=true puts a bias on o_proj but not on the MLP; "
                          "plugtron has one --add-bias-linear for every linear layer")
    if attention != mlp:
        raise ConfigError("attention_bias and mlp_bias differ; plugtron has one "
                          "--add-bias-linear for all linear layers")
    return {"add-bias-linear": attention}


def family_flags(c: dict, family: str) -> dict:
    """The flags of the family-specific fields (biases, window, rope, q/k norms)."""
    flags = bias_flags(c, family) | window_flags(c, family) | rope_flags(c)
    if family == "qwen3":
        flags["qk-layernorm"] = True
    return flags


# --------------------------------------------------------------------------- export


def family_of(config) -> str:
    """Which family a plugtron run config is exported as, or ConfigError saying why none."""
    m, o = config.model, attention_options(config)
    qkv_only = o.add_qkv_bias and not m.add_bias_linear
    if o.rotary_percent != 1.0:
        raise ConfigError(f"--rotary-percent {o.rotary_percent}: none of the Hugging Face "
                          f"families plugtron exports (Llama, Mistral, Qwen2, Qwen3) turns part "
                          f"of a head; export-megatron writes it")
    if o.qk_layernorm:
        if m.add_bias_linear or qkv_only:
            raise ConfigError("--qk-layernorm exports as Qwen3, which has no MLP biases and no "
                              "q/k/v-only biases; use --disable-bias-linear without "
                              "--add-qkv-bias")
        return "qwen3"
    if qkv_only:
        return "qwen2"
    if parse_window(o.window_size) is not None:
        if m.add_bias_linear:
            raise ConfigError("--window-size exports as Mistral (or Qwen2 with --add-qkv-bias), "
                              "neither of which has biases on every linear layer")
        return "mistral"
    return "llama"


def rope_config(config) -> dict:
    """``rope_theta`` and ``rope_parameters`` of a run config for config.json (shared with the
    converters of models that extend gpt: ``GPTConverter.hf_rope_config``)."""
    theta = float(config.model.rotary_base)
    rope = {"rope_theta": theta, "rope_type": "default"}
    scaling = rope_scaling(config)
    if scaling is not None:
        rope = {"rope_theta": theta} | scaling
        if (scaling["rope_type"] == "yarn"
                and not (scaling["mscale"] and scaling["mscale_all_dim"])
                and yarn_attention_factor(scaling) != yarn_mscale(scaling["factor"])):
            # transformers would infer mscale(factor) from these: state plugtron's value
            rope["attention_factor"] = yarn_attention_factor(scaling)
    return {"rope_theta": theta, "rope_parameters": rope}


def family_config(config, family: str) -> dict:
    """The family-specific config.json fields of ``config``."""
    m, o = config.model, attention_options(config)
    out = {"architectures": [ARCHITECTURES[family]], "model_type": family,
           **rope_config(config)}
    window = parse_window(o.window_size)
    size = window[0] + 1 if window is not None else None
    if family == "llama":
        out.update({"attention_bias": m.add_bias_linear, "mlp_bias": m.add_bias_linear})
    elif family == "mistral":
        out["sliding_window"] = size
    else:
        kind = "sliding_attention" if window is not None else "full_attention"
        out.update({"use_sliding_window": window is not None, "sliding_window": size,
                    "max_window_layers": 0 if window is not None else m.num_layers,
                    "layer_types": [kind] * m.num_layers})
        if family == "qwen3":
            out["attention_bias"] = False
    return out
