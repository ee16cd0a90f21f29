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

Multi-latent attention (``--multi-latent-attention``; Megatron's ``MLASelfAttention``) maps by
name: ``self_attention.linear_q_proj`` (no ``--q-lora-rank``) or ``linear_q_down_proj`` +
``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``. Megatron
has latent norms only with ``qk_layernorm`` (plugtron always has them, so export says
``qk_layernorm=True``), and its TE spec fuses them into the up-projections:
``linear_q_up_proj.layer_norm_weight`` is plugtron's ``q_layernorm.weight``,
``linear_kv_up_proj.layer_norm_weight`` its ``kv_layernorm.weight``; the MLA layer's input norm
stays ``input_layernorm.weight`` (there is no ``linear_qkv`` to fuse it into). Without query
compression Megatron-Core 0.19 adds a norm before ``linear_q_proj`` (qk_layernorm on) or drops
the kv latent norm (off), so such a model is not exported; a checkpoint without that norm
(Megatron's layout before 0.19) imports. The local spec keeps ``q_layernorm`` /
``kv_layernorm``; both are read, export writes the TE names. In general a TE
``X.layer_norm_*`` is written only where the layer has the linear ``X`` (an MoE layer keeps
``pre_mlp_layernorm.weight``, as Megatron's TE spec does).

Multi-token prediction (``--mtp-num-layers``): ``mtp.layers.{k}.{enorm,hnorm,eh_proj,
final_layernorm}`` by name; plugtron's ``mtp.layers.{k}.mtp_model_layer.*`` is Megatron's
``mtp.layers.{k}.transformer_layer.*`` (the name its GPT MTP layer keeps in checkpoints), with
the same norm names as a decoder layer. MTP layers are never stacked.

A converter that extends this model (plugtron-moe's, for MoE layers) calls
:func:`import_megatron` with ``foreign_mlp`` (the layers whose ``mlp.*`` it maps itself) and
:func:`export_megatron` with ``stacked`` (False: ``decoder.layers.{i}.*`` keys, Megatron's form
whenever ``--moe-layer-freq`` is a list).

Model settings come from Megatron's saved ``args`` (its flag names are plugtron's), else from
the tensor shapes plus the flags given on the command line.
"""

from __future__ import annotations

import argparse
import io
import re

import torch
from plugtron.api import ConfigError
from plugtron_gpt.gpt.megatron_args import (
    FEATURE_ARGS,
    FROM_MEGATRON,
    MAPPED_FEATURES,
    MEGATRON_ROPE_CONSTANTS,
    MLA_ARGS,
    MLA_YARN_CONSTANTS,
    MODEL_ARGS,
)
from plugtron_gpt.gpt.param_names import EMBEDDING, FINAL_NORM, OUTPUT, POSITIONS
from plugtron_gpt.layers.attention_options import attention_options, parse_window
from plugtron_gpt.layers.mlp import openai_gelu, squared_relu

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(transformer_layer|mtp_model_layer)\.(.+)$")
_MTP_DEPTH = re.compile(r"^mtp\.layers\.(\d+)\.")  # any tensor of MTP depth k
#: Megatron TE-spec name (under a layer) -> plugtron's (local-spec) name. On export a TE name
#: ``X.layer_norm_*`` is written only where the layer has the linear ``X``.
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
             "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
             "self_attention.linear_q_up_proj.layer_norm_bias": "self_attention.q_layernorm.bias",
             "self_attention.linear_kv_up_proj.layer_norm_weight":
                 "self_attention.kv_layernorm.weight",
             "self_attention.linear_kv_up_proj.layer_norm_bias":
                 "self_attention.kv_layernorm.bias"}


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
            mtp = _MTP_LAYER.match(key)
            if mtp:  # Megatron's GPT MTP layer saves its decoder layer as transformer_layer
                rest = mtp.group(3)
                key = f"mtp.layers.{mtp.group(1)}.mtp_model_layer.{_TE_NORMS.get(rest, rest)}"
            if key in out:
                raise ConfigError(f"the checkpoint gives {key!r} twice")
            out[key] = tensor
            continue
        for i, rest, t in pieces:
            name = f"decoder.layers.{i}.{_TE_NORMS.get(rest, rest)}"
            if name in out:
                raise ConfigError(f"{key!r} gives layer {i} a second {name!r}")
            out[name] = t.clone() if len(pieces) > 1 else t
        del pieces, tensor
    for name in [n for n in out if n.endswith(".weight_w")]:
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


def import_megatron(args: dict | None, given: dict, tensors: dict, flag_names,
                    foreign_mlp: frozenset = frozenset()) -> tuple:
    """-> (plugtron flag values, {plugtron name: tensor}). ``args``: the checkpoint's saved
    Megatron args (None when it has none); ``given``: settings from the command line, which win;
    ``flag_names``: plugtron's model flag names (underscored), for args it may have gained;
    ``foreign_mlp``: layer prefixes (``decoder.layers.3``, ``mtp.layers.0.mtp_model_layer``)
    whose ``mlp.*`` another converter maps (and has taken out of ``tensors``)."""
    layers = (given.get("num_layers") or (args or {}).get("num_layers")
              or _layer_count(tensors))
    q_norm = [k for k in tensors if k.endswith("self_attention.linear_q_proj.layer_norm_weight")]
    if q_norm:
        raise ConfigError(f"{q_norm[0]!r}: the checkpoint's multi-latent attention normalises "
                          f"the hidden state again before linear_q_proj (Megatron-Core 0.19 "
                          f"does so with qk_layernorm and no q_lora_rank); plugtron's MLA has "
                          f"no such norm")
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
        if name in FROM_MEGATRON and name in flag_names:
            settings.update(FROM_MEGATRON[name](value, args or {}, given, settings))
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
                          "--rotary-base where not Megatron's defaults; with multi-latent "
                          "attention its --q-lora-rank, --kv-lora-rank, ... flags)")
    _check_shapes(settings, t, foreign_mlp)
    flags = {k.replace("_", "-"): v for k, v in settings.items() if v is not None}
    return flags, t


def _layer_prefixes(s: dict) -> list[str]:
    """Every decoder layer's prefix, then every MTP layer's."""
    return [f"decoder.layers.{i}" for i in range(s["num_layers"])] + \
        [f"mtp.layers.{k}.mtp_model_layer" for k in range(s.get("mtp_num_layers") or 0)]


def _attention_shapes(s: dict) -> dict:
    """{name under a layer: shape} of the attention's weights."""
    heads, hidden = s["num_attention_heads"], s["hidden_size"]
    if s.get("multi_latent_attention"):
        q_dim = s.get("qk_head_dim", 128) + s.get("qk_pos_emb_head_dim", 64)
        kv_rank, q_rank = s.get("kv_lora_rank", 32), s.get("q_lora_rank")
        a = "self_attention"
        out = {f"{a}.linear_kv_down_proj.weight": (kv_rank + s.get("qk_pos_emb_head_dim", 64),
                                                   hidden),
               f"{a}.kv_layernorm.weight": (kv_rank,),
               f"{a}.linear_kv_up_proj.weight": (heads * (s.get("qk_head_dim", 128)
                                                          + s.get("v_head_dim", 128)), kv_rank),
               f"{a}.linear_proj.weight": (hidden, heads * s.get("v_head_dim", 128))}
        if q_rank is None:
            out[f"{a}.linear_q_proj.weight"] = (heads * q_dim, hidden)
        else:
            out.update({f"{a}.linear_q_down_proj.weight": (q_rank, hidden),
                        f"{a}.q_layernorm.weight": (q_rank,),
                        f"{a}.linear_q_up_proj.weight": (heads * q_dim, q_rank)})
        return out
    groups = s.get("num_query_groups") or heads
    d = s.get("kv_channels") or hidden // heads
    out = {"self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, hidden),
           "self_attention.linear_proj.weight": (hidden, heads * d)}
    if s.get("add_bias_linear", True) or s.get("add_qkv_bias"):
        out["self_attention.linear_qkv.bias"] = ((heads + 2 * groups) * d,)
    if s.get("qk_layernorm"):
        out["self_attention.q_layernorm.weight"] = out["self_attention.k_layernorm.weight"] \
            = (d,)
    return out


def _check_shapes(s: dict, t: dict, foreign_mlp=frozenset()) -> None:
    """The fused tensors agree with the settings (wrong heads or groups would convert to a
    different model silently otherwise)."""
    hidden = s["hidden_size"]
    ffn = s.get("ffn_hidden_size") or 4 * hidden
    mlp = {"mlp.linear_fc1.weight": (ffn * (2 if s.get("swiglu") else 1), hidden),
           "mlp.linear_fc2.weight": (hidden, ffn)}
    expected = _expected_names(s, foreign_mlp)
    unused = sorted(set(t) - expected)
    if unused:
        raise ConfigError(f"the checkpoint has tensors this model does not use: {unused[:8]} "
                          f"(a feature plugtron's GPT model lacks, or settings that disagree "
                          f"with the checkpoint)")
    missing = sorted(expected - set(t))
    if missing:
        raise ConfigError(f"the checkpoint lacks tensors the model settings need: "
                          f"{missing[:8]}")
    depth = s.get("mtp_num_layers") or 0
    want_mtp = {"eh_proj.weight": (hidden, 2 * hidden)}
    for prefix in _layer_prefixes(s):
        want = {**_attention_shapes(s), **({} if prefix in foreign_mlp else mlp)}
        for rest, shape in want.items():
            name = f"{prefix}.{rest}"
            if tuple(t[name].shape) != shape:
                raise ConfigError(f"{name!r} has shape {tuple(t[name].shape)}; the model "
                                  f"settings ({_described(s)}) need {shape}")
    for k in range(depth):
        for rest, shape in want_mtp.items():
            name = f"mtp.layers.{k}.{rest}"
            if tuple(t[name].shape) != shape:
                raise ConfigError(f"{name!r} has shape {tuple(t[name].shape)}; hidden size "
                                  f"{hidden} needs {shape}")


def _described(s: dict) -> str:
    keys = ("num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
            "swiglu", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
            "v_head_dim")
    return ", ".join(f"{k} {s[k]}" for k in keys if s.get(k) is not None)


def _expected_names(s: dict, foreign_mlp=frozenset()) -> set:
    norm = ("weight", "bias") if s.get("normalization", "LayerNorm") == "LayerNorm" else \
        ("weight",)
    linear = ("weight", "bias") if s.get("add_bias_linear", True) else ("weight",)
    names = {EMBEDDING} | {f"{FINAL_NORM}.{k}" for k in norm}
    if s.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        names.add(POSITIONS)
    if s.get("untie_embeddings_and_output_weights"):
        names.add(OUTPUT)
    for layer in _layer_prefixes(s):
        names |= {f"{layer}.{n}.{k}" for n in ("input_layernorm", "pre_mlp_layernorm")
                  for k in norm}
        if layer not in foreign_mlp:
            names |= {f"{layer}.mlp.{n}.{k}" for n in ("linear_fc1", "linear_fc2")
                      for k in linear}
        if s.get("multi_latent_attention"):  # no biases but on linear_proj (Megatron's)
            for rest in _attention_shapes(s):
                if rest.endswith("layernorm.weight"):
                    names |= {f"{layer}.{rest[:-len('weight')]}{k}" for k in norm}
                else:
                    names.add(f"{layer}.{rest}")
            if "bias" in linear:
                names.add(f"{layer}.self_attention.linear_proj.bias")
            continue
        names |= {f"{layer}.self_attention.{n}.{k}" for n in ("linear_qkv", "linear_proj")
                  for k in linear}
        if s.get("add_qkv_bias"):  # Qwen2: bias on q, k, v only, fused like the weight
            names.add(f"{layer}.self_attention.linear_qkv.bias")
        if s.get("qk_layernorm"):  # Qwen3: a norm per head over its channels
            names |= {f"{layer}.self_attention.{n}.{k}" for n in ("q_layernorm", "k_layernorm")
                      for k in norm}
    for k in range(s.get("mtp_num_layers") or 0):
        names |= {f"mtp.layers.{k}.{n}.{w}" for n in ("enorm", "hnorm", "final_layernorm")
                  for w in norm}
        names.add(f"mtp.layers.{k}.eh_proj.weight")
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
    mtp = getattr(config, "mtp", None)
    if openai_gelu(config):
        raise ConfigError("--openai-gelu cannot be exported to Megatron-Core: its GPTModel "
                          "computes exact GeLU whatever --openai-gelu says (only the removed "
                          "legacy models read it), so the exported model would differ")
    out = {"add_qkv_bias": bool(m.add_bias_linear or o.add_qkv_bias),
           "qk_layernorm": o.qk_layernorm, "squared_relu": squared_relu(config),
           "window_size": parse_window(o.window_size),
           "rotary_seq_len_interpolation_factor": o.rotary_seq_len_interpolation_factor,
           "use_rope_scaling": o.use_rope_scaling, "rotary_percent": o.rotary_percent}
    if o.multi_latent_attention:
        out.update(_mla_args(o))
    elif o.rope_type == "yarn":
        raise ConfigError("--rope-type yarn without --multi-latent-attention cannot be exported "
                          "to Megatron-Core yet (its GPTModel takes YaRN as "
                          "--position-embedding-type yarn, which plugtron does not map)")
    if mtp is not None and mtp.mtp_num_layers:
        out.update(mtp_num_layers=mtp.mtp_num_layers,
                   mtp_loss_scaling_factor=mtp.mtp_loss_scaling_factor)
    if o.use_rope_scaling:
        for name, value in MEGATRON_ROPE_CONSTANTS.items():
            if getattr(o, name) != value:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(o, name)} cannot be "
                                  f"exported to Megatron-Core, which fixes it at {value} (only "
                                  f"--rope-scaling-factor is an argument there)")
        out["rope_scaling_factor"] = o.rope_scaling_factor
    return out


def refuse_uncompressed_queries(o) -> None:
    """Megatron-Core 0.19 cannot compute plugtron's MLA without query compression: with
    ``qk_layernorm`` (which the kv latent norm needs) its MLA puts a norm over the hidden state
    before ``linear_q_proj`` (the TE spec's fused ``linear_q_proj.layer_norm_weight``;
    transformer/mla_qk_norm_config.py), and without it there is no kv latent norm."""
    if o.q_lora_rank is None:
        raise ConfigError("--multi-latent-attention without --q-lora-rank cannot be exported to "
                          "Megatron-Core 0.19: with the latent norms on (qk_layernorm, which "
                          "plugtron's kv_layernorm needs) its MLA normalises the hidden state "
                          "once more before linear_q_proj (linear_q_proj.layer_norm_weight), "
                          "which plugtron's MLA does not; with them off it has no kv latent "
                          "norm. Export a model with --q-lora-rank, or to Hugging Face "
                          "(deepseek_v3)")


def _mla_args(o) -> dict:
    """Megatron's MLA args: the latent norms are its ``qk_layernorm``; rope_type always said
    (Megatron's MLA takes YaRN when it is not)."""
    refuse_uncompressed_queries(o)
    if o.rope_type == "yarn":
        for name, value in MLA_YARN_CONSTANTS.items():
            if getattr(o, name) != value:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(o, name)} cannot be "
                                  f"exported to Megatron-Core, whose multi-latent attention "
                                  f"fixes it at {value} (only --rotary-scaling-factor, --mscale "
                                  f"and --mscale-all-dim are arguments there)")
    # the latent norms' keys are the TE spec's (fused into the up-projections)
    return {"multi_latent_attention": True, "qk_layernorm": True,
            "transformer_impl": "transformer_engine",
            # Megatron's fused MLA rope takes YaRN only (it refuses the config otherwise); a
            # kernel choice, not the model's
            "apply_rope_fusion": False,
            "rope_type": o.rope_type or "rope", **{k: getattr(o, k) for k in MLA_ARGS}}


def _linear_modules(rests) -> list[str]:
    """The linear modules (Megatron saves an ``_extra_state`` for each) among layer tensor
    names."""
    return sorted({r[:-len(".weight")] for r in rests if r.endswith(".weight")
                   and r.rsplit(".", 2)[-2].startswith(("linear_", "eh_proj"))})


def _te_name(rest: str, present) -> str:
    """plugtron's name under a layer -> the TE spec's, fused where the layer has the linear."""
    for te, ours in _TE_NORMS.items():
        if rest == ours and f"{te.rsplit('.', 1)[0]}.weight" in present:
            return te
    return rest


def extra_state_objects(keys_and_shards) -> dict:
    """``{object key: bytes}`` of the ``_extra_state`` objects Megatron's linear layers save
    (``None`` each, a local-spec linear's; Megatron stores ``torch.save([data])``).
    ``keys_and_shards``: (module key, offsets, shape) of each shard."""
    none = io.BytesIO()
    torch.save([None], none)
    out = {}
    for key, offsets, shape in keys_and_shards:
        shard = f"shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"
        out[f"{key}._extra_state/{shard}"] = io.BytesIO(none.getvalue())
    return out


def export_megatron(config, tensors: dict, padded_vocab: int,
                    stacked: bool | None = None) -> tuple[argparse.Namespace, dict]:
    """-> (Megatron ``args``, {Megatron key: tensor or ``_extra_state`` object}): norms under
    their TE names; decoder layers stacked when ``stacked`` (None: when every layer holds the
    same tensors), else ``decoder.layers.{i}.*``; MTP layers one by one."""
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
    out: dict = {}
    per_layer: dict = {}
    mtp_layers: dict = {}
    # The config's MTP depth, not the checkpoint's: ``--drop mtp`` leaves those layers out.
    depth = getattr(getattr(config, "mtp", None), "mtp_num_layers", None) or 0
    for name in tensors:  # names only: ``tensors`` may read each tensor when it is looked up
        match = _LAYER.match(name)
        mtp = _MTP_LAYER.match(name)
        dropped = _MTP_DEPTH.match(name)
        if dropped and int(dropped.group(1)) >= depth:
            continue
        if match:
            per_layer.setdefault(int(match.group(1)), []).append(match.group(2))
        elif mtp:
            mtp_layers.setdefault(int(mtp.group(1)), []).append(mtp.group(3))
        else:
            out[name] = tensors[name]
    if sorted(per_layer) != list(range(m.num_layers)):
        raise ConfigError(f"the checkpoint has decoder layers {sorted(per_layer)}, not each of "
                          f"{m.num_layers}")
    kinds = {tuple(sorted(rests)) for rests in per_layer.values()}
    if stacked is None:
        stacked = len(kinds) == 1
    elif stacked and len(kinds) > 1:
        raise ConfigError("the decoder layers hold different tensors: cannot stack them "
                          "(Megatron saves such layers one by one)")
    objects = []
    if stacked:
        rests = per_layer[0]
        for rest in rests:
            names = [f"decoder.layers.{i}.{rest}" for i in range(m.num_layers)]
            out[f"decoder.layers.{_te_name(rest, rests)}"] = _stacked(names, tensors)
        objects += [(f"decoder.layers.{module}", (i,), (m.num_layers,))
                    for module in _linear_modules(rests) for i in range(m.num_layers)]
    else:
        for i, rests in sorted(per_layer.items()):
            for rest in rests:
                out[f"decoder.layers.{i}.{_te_name(rest, rests)}"] = \
                    tensors[f"decoder.layers.{i}.{rest}"]
            objects += [(f"decoder.layers.{i}.{module}", (0,), (1,))
                        for module in _linear_modules(rests)]
    for k, rests in sorted(mtp_layers.items()):
        for rest in rests:
            out[f"mtp.layers.{k}.transformer_layer.{_te_name(rest, rests)}"] = \
                tensors[f"mtp.layers.{k}.mtp_model_layer.{rest}"]
        objects += [(f"mtp.layers.{k}.transformer_layer.{module}", (0,), (1,))
                    for module in _linear_modules(rests)]
    objects += [(f"mtp.layers.{k}.eh_proj", (0,), (1,)) for k in sorted(mtp_layers)]
    for name in (EMBEDDING, OUTPUT):
        if name in out and out[name].shape[0] < padded_vocab:
            pad = out[name].new_zeros((padded_vocab - out[name].shape[0],
                                       *out[name].shape[1:]))
            out[name] = torch.cat([out[name], pad])
    # Megatron's linear layers checkpoint an ``_extra_state`` object each (None for the local
    # spec's, fp8 metadata for TE's) and its loader requires them.
    out.update(extra_state_objects(objects))
    if f"{FINAL_NORM}.weight" not in out:
        raise ConfigError("the checkpoint has no final layer norm: not a GPT checkpoint")
    return argparse.Namespace(**args), out
