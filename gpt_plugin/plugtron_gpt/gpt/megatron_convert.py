"""Megatron-Core GPTModel <-> plugtron GPT: names, fused layouts and the saved ``args``.

plugtron's parameter names and fused layouts are Megatron-Core's (``linear_qkv`` per query group
``[q_1..q_n, k, v]``, ``linear_fc1`` ``[gate; up]`` for SwiGLU), so most tensors map by name.
What differs in a torch_dist checkpoint:

* layers are **stacked**: the default sharded state dict (``non_homogeneous_layers`` off) saves
  ``decoder.layers.<param>`` with a leading axis of ``num_layers``; with it on (or
  ``singleton_local_shards``) keys read ``decoder.layers.<i>.<param>``. Both are read; export
  writes the stacked form, which Megatron loads by default;
* the pre-norms are saved under the **TE spec**'s names, where each is fused into the
  following linear: ``self_attention.linear_qkv.layer_norm_{weight,bias}`` is plugtron's
  ``input_layernorm`` and ``mlp.linear_fc1.layer_norm_{weight,bias}`` its
  ``pre_mlp_layernorm``. The local spec has separate norm modules (as plugtron) but maps them to
  the same checkpoint keys (its ``sharded_state_dict_keys_map``), so both specs' checkpoints
  read alike; the module names are accepted too, and export writes the TE names;
* with ``singleton_local_shards`` SwiGLU's fc1 is saved as two keys ``linear_fc1.weight_w``
  (gate) and ``linear_fc1.weight_v`` (up);
* TE's ``_extra_state`` (fp8 scaling state) and the optimizer / RNG entries are not weights and
  are skipped by the core.

Model settings come from Megatron's saved ``args`` (its flag names are plugtron's), else from
the tensor shapes plus the flags given on the command line.
"""

from __future__ import annotations

import argparse
import io
import re

import torch
from plugtron.api import ConfigError
from plugtron_gpt.gpt.param_names import EMBEDDING, FINAL_NORM, OUTPUT, POSITIONS
from plugtron_gpt.layers.attention_options import attention_options, parse_window
from plugtron_gpt.layers.mlp import openai_gelu, squared_relu

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
#: Megatron TE-spec name (under a layer) -> plugtron's (local-spec) name.
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}

#: Megatron args that are plugtron GPT model flags of the same name.
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "kv_channels", "seq_length", "max_position_embeddings", "vocab_size",
              "make_vocab_size_divisible_by", "position_embedding_type", "rotary_base",
              "normalization", "norm_epsilon", "swiglu", "untie_embeddings_and_output_weights",
              "add_bias_linear", "hidden_dropout", "attention_dropout", "init_method_std")
#: Megatron args that change the model, with the value under which plugtron's GPT computes the
#: same thing; another value is refused unless plugtron has a model option of that name (or a
#: translation in _FROM_MEGATRON).
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


#: The feature args this converter maps (with their tensors, where they have any); any other
#: is refused by name even where plugtron has an option of that name (num_experts: the MoE
#: model's experts are not this converter's).
MAPPED_FEATURES = ("add_qkv_bias", "qk_layernorm", "openai_gelu", "squared_relu", "window_size",
                   "use_rope_scaling", "rotary_seq_len_interpolation_factor")
#: Megatron arg -> its plugtron settings, where the forms differ.
_FROM_MEGATRON = {"add_qkv_bias": _qkv_bias, "openai_gelu": _openai_gelu, "window_size": _window,
                  "use_rope_scaling": _rope_scaling}


def _unstack(tensors: dict, num_layers: int | None) -> dict:
    """Megatron's keys -> plugtron's: layers unstacked, TE norms unfused, fc1 w/v joined.
    Empties ``tensors`` as it goes (each stacked tensor is freed once its layers are copied
    out, so the model is not held twice)."""
    out = {}
    for key in list(tensors):
        tensor = tensors.pop(key)
        match = _LAYER.match(key)
        if match:
            pieces = [(int(match.group(1)), match.group(2), tensor)]
        elif key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            if tensor.dim() == 0 or (num_layers is not None and tensor.shape[0] != num_layers):
                raise ConfigError(f"stacked tensor {key!r} has shape {tuple(tensor.shape)}; its "
                                  f"leading axis must be num_layers={num_layers}")
            pieces = [(i, rest, t) for i, t in enumerate(tensor.unbind(0))]
        else:
            out[key] = tensor
            continue
        for i, rest, t in pieces:
            name = f"decoder.layers.{i}.{_TE_NORMS.get(rest, rest)}"
            if name in out:
                raise ConfigError(f"{key!r} gives layer {i} a second {name!r}")
            out[name] = t.clone() if len(pieces) > 1 else t
        del pieces, tensor
    for name in [n for n in out if n.endswith("linear_fc1.weight_w")]:
        up = out.pop(name[:-1] + "v", None)
        if up is None:
            raise ConfigError(f"{name!r} has no matching {name[:-1] + 'v'!r}")
        out[name[:-2]] = torch.cat([out.pop(name), up])
    return out


def _layer_count(tensors: dict) -> int | None:
    for key, t in tensors.items():
        if key.startswith("decoder.layers.") and not _LAYER.match(key) and t.dim():
            return t.shape[0]
    indices = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    return max(indices) + 1 if indices else None


def _inferred(t: dict, layers: int | None) -> dict:
    """What the tensors say about the model (used where the checkpoint saved no args)."""
    emb = t.get(EMBEDDING)
    if emb is None:
        raise ConfigError(f"the checkpoint has no {EMBEDDING!r}: not a GPTModel checkpoint")
    fc1, fc2 = t.get("decoder.layers.0.mlp.linear_fc1.weight"), \
        t.get("decoder.layers.0.mlp.linear_fc2.weight")
    norm = "decoder.layers.0.input_layernorm"
    out = {"num_layers": layers, "hidden_size": emb.shape[1],
           "position_embedding_type": "learned_absolute" if POSITIONS in t else "rope",
           "untie_embeddings_and_output_weights": OUTPUT in t,
           "add_bias_linear": "decoder.layers.0.self_attention.linear_proj.bias" in t,
           "normalization": "LayerNorm" if f"{norm}.bias" in t else "RMSNorm"}
    if fc1 is not None and fc2 is not None:
        out["ffn_hidden_size"] = fc2.shape[1]
        out["swiglu"] = fc1.shape[0] == 2 * fc2.shape[1]
    if POSITIONS in t:
        out["max_position_embeddings"] = t[POSITIONS].shape[0]
    return out


def _inferred_features(t: dict) -> dict:
    """The options the tensors show, for a checkpoint without args (a window or rope scaling
    leaves no tensor: give --window-size / --use-rope-scaling)."""
    attn = "decoder.layers.0.self_attention"
    out = {}
    if f"{attn}.linear_qkv.bias" in t and f"{attn}.linear_proj.bias" not in t:
        out["add_qkv_bias"] = True
    if f"{attn}.q_layernorm.weight" in t:
        out["qk_layernorm"] = True
    return out


def import_megatron(args: dict | None, given: dict, tensors: dict, flag_names) -> tuple:
    """-> (plugtron flag values, {plugtron name: tensor}). ``args``: the checkpoint's saved
    Megatron args (None when it has none); ``given``: settings from the command line, which win;
    ``flag_names``: plugtron's model flag names (underscored), for args it may have gained."""
    layers = (given.get("num_layers") or (args or {}).get("num_layers")
              or _layer_count(tensors))
    t = _unstack(tensors, layers)
    settings = {**_inferred(t, layers), **{k: v for k, v in (args or {}).items()
                                           if k in MODEL_ARGS and v is not None}, **given}
    if args is not None and not args.get("group_query_attention", False):
        settings.setdefault("num_query_groups", None)
    elif args is not None and args.get("num_query_groups"):
        settings.setdefault("num_query_groups", args["num_query_groups"])
    if args is None:
        settings = {**_inferred_features(t), **settings}
    flag_names = set(flag_names) & set(MAPPED_FEATURES)
    for name, plain in FEATURE_ARGS.items():
        value = given.get(name, (args or {}).get(name, plain))
        if name in _FROM_MEGATRON and name in flag_names:
            settings.update(_FROM_MEGATRON[name](value, args or {}, given, settings))
            continue
        if value == plain or value is None and plain is False:
            continue
        if name not in flag_names:
            raise ConfigError(f"the Megatron checkpoint was trained with {name}={value!r}; "
                              f"plugtron's GPT model has no equivalent (it computes "
                              f"{name}={plain!r}), so converting would change the model")
        settings[name] = value
    if args is None and "num_attention_heads" not in settings:
        raise ConfigError("the checkpoint saved no args (common.pt has no 'args'): give the "
                          "model flags the shapes cannot tell, at least --num-attention-heads "
                          "(and --num-query-groups, --kv-channels, --norm-epsilon, "
                          "--rotary-base where not Megatron's defaults)")
    _check_shapes(settings, t)
    flags = {k.replace("_", "-"): v for k, v in settings.items() if v is not None}
    return flags, t


def _check_shapes(s: dict, t: dict) -> None:
    """The fused tensors agree with the settings (wrong heads or groups would convert to a
    different model silently otherwise)."""
    heads = s.get("num_attention_heads")
    groups = s.get("num_query_groups") or heads
    hidden = s["hidden_size"]
    d = s.get("kv_channels") or hidden // heads
    ffn = s.get("ffn_hidden_size") or 4 * hidden
    want = {"self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, hidden),
            "self_attention.linear_proj.weight": (hidden, heads * d),
            "mlp.linear_fc1.weight": (ffn * (2 if s.get("swiglu") else 1), hidden),
            "mlp.linear_fc2.weight": (hidden, ffn)}
    if s.get("add_bias_linear", True) or s.get("add_qkv_bias"):
        want["self_attention.linear_qkv.bias"] = ((heads + 2 * groups) * d,)
    if s.get("qk_layernorm"):
        want["self_attention.q_layernorm.weight"] = want["self_attention.k_layernorm.weight"] \
            = (d,)
    expected = _expected_names(s)
    unused = sorted(set(t) - expected)
    if unused:
        raise ConfigError(f"the checkpoint has tensors this model does not use: {unused[:8]} "
                          f"(a feature plugtron's GPT model lacks, or settings that disagree "
                          f"with the checkpoint)")
    missing = sorted(expected - set(t))
    if missing:
        raise ConfigError(f"the checkpoint lacks tensors the model settings need: "
                          f"{missing[:8]}")
    for i in range(s["num_layers"]):
        for rest, shape in want.items():
            name = f"decoder.layers.{i}.{rest}"
            if name not in t:
                raise ConfigError(f"the checkpoint has no {name!r}")
            if tuple(t[name].shape) != shape:
                raise ConfigError(f"{name!r} has shape {tuple(t[name].shape)}; the model "
                                  f"settings (heads {heads}, groups {groups}, kv channels {d}, "
                                  f"ffn {ffn}, swiglu {bool(s.get('swiglu'))}) need {shape}")


def _expected_names(s: dict) -> set:
    norm = ("weight", "bias") if s.get("normalization", "LayerNorm") == "LayerNorm" else \
        ("weight",)
    linear = ("weight", "bias") if s.get("add_bias_linear", True) else ("weight",)
    names = {EMBEDDING} | {f"{FINAL_NORM}.{k}" for k in norm}
    if s.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        names.add(POSITIONS)
    if s.get("untie_embeddings_and_output_weights"):
        names.add(OUTPUT)
    for i in range(s["num_layers"]):
        layer = f"decoder.layers.{i}"
        names |= {f"{layer}.{n}.{k}" for n in ("input_layernorm", "pre_mlp_layernorm")
                  for k in norm}
        names |= {f"{layer}.{n}.{k}" for n in ("self_attention.linear_qkv",
                                               "self_attention.linear_proj",
                                               "mlp.linear_fc1", "mlp.linear_fc2")
                  for k in linear}
        if s.get("add_qkv_bias"):  # Qwen2: bias on q, k, v only, fused like the weight
            names.add(f"{layer}.self_attention.linear_qkv.bias")
        if s.get("qk_layernorm"):  # Qwen3: a norm per head over its channels
            names |= {f"{layer}.self_attention.{n}.{k}" for n in ("q_layernorm", "k_layernorm")
                      for k in norm}
    return names


def _stacked(names: list, tensors) -> torch.Tensor:
    """The layers' tensors on a leading axis, read one at a time into the stacked tensor (never
    all of them besides it)."""
    first = tensors[names[0]]
    out = first.new_empty((len(names), *first.shape))
    out[0] = first
    del first
    for i, name in enumerate(names[1:], 1):
        out[i] = tensors[name]
    return out


def _feature_args(config) -> dict:
    """Megatron's feature args for a plugtron config: its attention and MLP options in
    Megatron's forms; ConfigError where Megatron-Core cannot compute the model."""
    m, o = config.model, attention_options(config)
    if o.multi_latent_attention:
        raise ConfigError("--multi-latent-attention cannot be exported to Megatron-Core yet: "
                          "plugtron does not map MLA's projections to torch_dist (issue 27)")
    if getattr(getattr(config, "mtp", None), "mtp_num_layers", None):
        raise ConfigError("--mtp-num-layers cannot be exported to Megatron-Core yet: plugtron "
                          "does not map the MTP layers to torch_dist (issue 27)")
    if openai_gelu(config):
        raise ConfigError("--openai-gelu cannot be exported to Megatron-Core: its GPTModel "
                          "computes exact GeLU whatever --openai-gelu says (only the removed "
                          "legacy models read it), so the exported model would differ")
    out = {"add_qkv_bias": bool(m.add_bias_linear or o.add_qkv_bias),
           "qk_layernorm": o.qk_layernorm, "squared_relu": squared_relu(config),
           "window_size": parse_window(o.window_size),
           "rotary_seq_len_interpolation_factor": o.rotary_seq_len_interpolation_factor,
           "use_rope_scaling": o.use_rope_scaling}
    if o.use_rope_scaling:
        for name, value in MEGATRON_ROPE_CONSTANTS.items():
            if getattr(o, name) != value:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(o, name)} cannot be "
                                  f"exported to Megatron-Core, which fixes it at {value} (only "
                                  f"--rope-scaling-factor is an argument there)")
        out["rope_scaling_factor"] = o.rope_scaling_factor
    return out


def export_megatron(config, tensors: dict, padded_vocab: int) -> tuple[argparse.Namespace, dict]:
    """-> (Megatron ``args``, {Megatron key: tensor}): the keys both specs save (norms under
    their TE names), layers stacked."""
    m = config.model
    groups = m.num_query_groups or m.num_attention_heads
    args = {name: getattr(m, name) for name in MODEL_ARGS}
    args.update(num_query_groups=groups, group_query_attention=groups != m.num_attention_heads,
                kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
                ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
                max_position_embeddings=m.max_position_embeddings or m.seq_length,
                padded_vocab_size=padded_vocab, transformer_impl="local",
                ckpt_format="torch_dist", use_legacy_models=False,
                params_dtype=tensors[next(iter(tensors))].dtype,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    args.update(_feature_args(config))
    for name, plain in FEATURE_ARGS.items():
        args.setdefault(name, plain)
    fused = {v: k for k, v in _TE_NORMS.items()}
    out, per_layer = {}, {}
    for name in tensors:  # names only: ``tensors`` may read each tensor when it is looked up
        match = _LAYER.match(name)
        if match:
            rest = fused.get(match.group(2), match.group(2))
            per_layer.setdefault(rest, {})[int(match.group(1))] = name
        else:
            out[name] = tensors[name]
    for rest, by_layer in per_layer.items():
        if sorted(by_layer) != list(range(m.num_layers)):
            raise ConfigError(f"decoder.layers.*.{rest} is present for layers {sorted(by_layer)}"
                              f", not for each of {m.num_layers}: cannot stack")
        out[f"decoder.layers.{rest}"] = _stacked([by_layer[i] for i in range(m.num_layers)],
                                                 tensors)
    for name in (EMBEDDING, OUTPUT):
        if name in out and out[name].shape[0] < padded_vocab:
            pad = out[name].new_zeros((padded_vocab - out[name].shape[0],
                                       *out[name].shape[1:]))
            out[name] = torch.cat([out[name], pad])
    # Megatron's linear layers checkpoint an ``_extra_state`` object each (None for the local
    # spec's, fp8 metadata for TE's) and its loader requires them. Megatron stores each as
    # torch.save of the list of its shards' data: here ``[None]`` per layer.
    none = io.BytesIO()
    torch.save([None], none)
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                   "mlp.linear_fc2"):
        for i in range(m.num_layers):
            key = f"decoder.layers.{module}._extra_state/shard_{i}_{m.num_layers}"
            out[key] = io.BytesIO(none.getvalue())
    if f"{FINAL_NORM}.weight" not in out:
        raise ConfigError("the checkpoint has no final layer norm: not a GPT checkpoint")
    return argparse.Namespace(**args), out
