"""Megatron-Core ``torch_dist`` <-> plugtron for the ``gpt`` model with MoE layers (the
``import_megatron`` / ``export_megatron`` of plugtron-moe's converters: Mixtral/Qwen-MoE's and
DeepSeek-V3's, whichever claims the run).

This module maps the MoE layers' tensors and the ``moe_*`` args; everything else in the model
(embeddings, attention or multi-latent attention, norms, dense layers, multi-token prediction)
is the gpt converter's, reached through the registry (``load_plugin("converter", "gpt")``):
it is told which layers' ``mlp.*`` this module maps (``foreign_mlp``) and whether to stack.

Megatron-Core 0.19's sharded state dict of an MoE layer (``SequentialMLP`` and the grouped
``TEGroupedMLP`` save the same keys, so either reads the other's checkpoint), under a layer's
prefix (``decoder.layers.{i}``, ``decoder.layers`` stacked, ``mtp.layers.{k}.transformer_layer``):

===============================================  ==============================================
``mlp.router.weight [E, H]``                     the same name
``mlp.router.expert_bias [E]`` (fp32; saved      the same name
with ``--moe-router-enable-expert-bias``)
``mlp.experts.experts.linear_fc1.weight          ``mlp.experts.local_experts.{e}.linear_fc1
[E, 2F, H]`` (an expert axis; SwiGLU's           .weight`` for each expert e (fc2 alike)
``[gate; up]`` per expert)
``mlp.shared_experts.linear_fc{1,2}.weight``,    the same names
``mlp.shared_experts.gate_weight``
===============================================  ==============================================

Also read: ``singleton_local_shards`` saves (``mlp.experts.experts.{e}.linear_fc1.weight``, or
``..._w`` / ``..._v`` for SwiGLU's halves) and the modules' own names (``experts.local_experts.
{e}...`` of SequentialMLP, ``experts.linear_fc1.weight{e}`` of TEGroupedMLP). Layers are stacked
(a leading layer axis) when every layer is MoE and ``--moe-layer-freq`` is the int 1; with a
list (dense layers first) or an int above 1 Megatron saves ``decoder.layers.{i}.*`` keys, and
so does the export. Each expert's linear saves an ``_extra_state`` object per expert
(``.../shard_{e}_{E}``; ``shard_{i}.{e}_{L}.{E}`` stacked), written as ``None`` as a local
spec's linear does.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from dataclasses import fields

import torch
from plugtron.api import ConfigError, load_plugin, selected_driver

from .options import MoEOptions, moe_layer_pattern

#: The MoE options, each a Megatron arg of the same name.
MOE_ARGS = tuple(f.name for f in fields(MoEOptions))
#: MoE args that choose kernels, communication or logging, not the model: not taken from a
#: checkpoint (Megatron has values plugtron does not, such as the flex dispatcher); given
#: flags still count.
RUN_ARGS = ("moe_token_dispatcher_type", "moe_grouped_gemm", "moe_per_layer_logging")
#: Megatron MoE args that change the model, with the value under which plugtron computes the
#: same thing.
REFUSED_ARGS = {"moe_latent_size": None, "moe_apply_probs_on_input": False,
                "moe_use_upcycling": False}
_MOE_PART = re.compile(r"\.mlp\.(router|experts|shared_experts)\.")
_STACKED_EXPERTS = re.compile(r"^(.+\.mlp\.experts)\.experts\.(linear_fc[12]\.(?:weight|bias))$")
_SINGLETON = re.compile(r"^(.+\.mlp\.experts)\.experts\.(\d+)\.(linear_fc[12]\.\w+)$")
_GROUPED = re.compile(r"^(.+\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.")


def is_moe_key(name: str) -> bool:
    return bool(_MOE_PART.search(name))


def gpt_converter(model: str):
    converter = load_plugin("converter", model)
    return converter() if isinstance(converter, type) else converter


def megatron_layer_freq(freq, num_layers: int) -> int | list[int]:
    """plugtron's ``--moe-layer-freq`` text -> Megatron's parsed value (an int or a list)."""
    text = str(freq).strip()
    if text.isdigit():
        return int(text)
    return [int(b) for b in moe_layer_pattern(text, num_layers)]


def _plugtron_layer_freq(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(int(v)) for v in value) + "]"
    return str(value)


def moe_prefixes(pattern: list[bool], depth: int) -> list[str]:
    """plugtron prefixes of the layers with an MoE MLP: the decoder's, then the MTP layers'
    (of the kind of the model's last layer, as Megatron's MTP spec)."""
    out = [f"decoder.layers.{i}" for i, sparse in enumerate(pattern) if sparse]
    if pattern and pattern[-1]:
        out += [f"mtp.layers.{k}.mtp_model_layer" for k in range(depth)]
    return out


# ---------------------------------------------------------------------------------- import

def _unstacked(tensors: dict, layers: int) -> dict:
    """Stacked ``decoder.layers.mlp...`` keys -> one per layer; MTP's transformer_layer ->
    mtp_model_layer; the expert forms -> ``local_experts.{e}``; SwiGLU halves joined."""
    flat = {}
    for key, t in tensors.items():
        if key.startswith("decoder.layers.mlp."):
            if t.dim() == 0 or t.shape[0] != layers:
                raise ConfigError(f"stacked tensor {key!r} has shape {tuple(t.shape)}; its "
                                  f"leading axis must be num_layers={layers}")
            for i, piece in enumerate(t.unbind(0)):
                flat[f"decoder.layers.{i}.{key[len('decoder.layers.'):]}"] = piece
        else:
            flat[_MTP.sub(r"mtp.layers.\1.mtp_model_layer.", key)] = t
    out: dict = {}
    for key, t in flat.items():
        if m := _STACKED_EXPERTS.match(key):
            for e, piece in enumerate(t.unbind(0)):
                _put(out, f"{m.group(1)}.local_experts.{e}.{m.group(2)}", piece)
        elif m := _SINGLETON.match(key):
            _put(out, f"{m.group(1)}.local_experts.{m.group(2)}.{m.group(3)}", t)
        elif m := _GROUPED.match(key):
            _put(out, f"{m.group(1)}.local_experts.{m.group(4)}.{m.group(2)}.{m.group(3)}", t)
        else:
            _put(out, key, t)
    for name in [n for n in out if n.endswith(".weight_w")]:
        up = out.pop(name[:-1] + "v", None)
        if up is None:
            raise ConfigError(f"{name!r} has no matching {name[:-1] + 'v'!r}")
        out[name[:-2]] = torch.cat([out.pop(name), up])
    return out


def _put(out: dict, name: str, t: torch.Tensor) -> None:
    if name in out:
        raise ConfigError(f"the checkpoint gives {name!r} twice")
    out[name] = t.clone() if t._base is not None else t


def _expected(o: dict, prefix: str, hidden: int, ffn: int, swiglu: bool, bias: bool) -> dict:
    """{plugtron name: shape} of one MoE layer's MLP."""
    experts = o["num_experts"]
    moe_ffn = o.get("moe_ffn_hidden_size") or ffn
    out: dict[str, tuple[int, ...]] = {f"{prefix}.mlp.router.weight": (experts, hidden)}
    if o.get("moe_router_enable_expert_bias"):
        out[f"{prefix}.mlp.router.expert_bias"] = (experts,)

    def mlp(base: str, width: int) -> None:
        out[f"{base}.linear_fc1.weight"] = ((2 if swiglu else 1) * width, hidden)
        out[f"{base}.linear_fc2.weight"] = (hidden, width)
        if bias:
            out[f"{base}.linear_fc1.bias"] = ((2 if swiglu else 1) * width,)
            out[f"{base}.linear_fc2.bias"] = (hidden,)

    for e in range(experts):
        mlp(f"{prefix}.mlp.experts.local_experts.{e}", moe_ffn)
    shared = o.get("moe_shared_expert_intermediate_size")
    if shared:
        mlp(f"{prefix}.mlp.shared_experts", shared)
        if o.get("moe_shared_expert_gate"):
            out[f"{prefix}.mlp.shared_experts.gate_weight"] = (1, hidden)
    return out


def import_megatron(model: str, args: dict | None, given: dict, tensors: dict,
                    flag_names) -> tuple[dict, dict]:
    moe_names = set(MOE_ARGS)
    rest_args = None if args is None else {k: v for k, v in args.items() if k not in moe_names}
    saved = {k: v for k, v in (args or {}).items()
             if k in moe_names and k not in RUN_ARGS and v is not None}
    for name, plain in REFUSED_ARGS.items():
        value = (args or {}).get(name, plain)
        if value != plain and value is not None:
            raise ConfigError(f"the Megatron checkpoint was trained with {name}={value!r}; "
                              f"plugtron's MoE layer has no equivalent")
    o = {**saved, **{k: v for k, v in given.items() if k in moe_names}}
    if not o.get("num_experts"):
        raise ConfigError("the Megatron checkpoint has no num_experts (give --num-experts)")
    if "moe_layer_freq" in o:
        o["moe_layer_freq"] = _plugtron_layer_freq(o["moe_layer_freq"])
    if "moe_router_load_balancing_type" in o and isinstance(
            o["moe_router_load_balancing_type"], tuple):
        o["moe_router_load_balancing_type"] = list(o["moe_router_load_balancing_type"])
    layers = given.get("num_layers") or (args or {}).get("num_layers")
    if not layers:
        raise ConfigError("give --num-layers: the checkpoint saved no args")
    depth = given.get("mtp_num_layers", (args or {}).get("mtp_num_layers")) or 0
    pattern = moe_layer_pattern(o.get("moe_layer_freq", "1"), layers)
    prefixes = moe_prefixes(pattern, depth)
    ours = _unstacked({k: tensors.pop(k) for k in list(tensors) if is_moe_key(k)}, layers)
    bare = [p for p in prefixes if f"{p}.mlp.router.weight" not in ours]
    if bare:
        raise ConfigError(f"the Megatron checkpoint was trained with num_experts="
                          f"{o['num_experts']} and moe_layer_freq "
                          f"{o.get('moe_layer_freq', '1')}, but holds no router for "
                          f"{', '.join(bare[:4])} (a dense checkpoint, or settings that "
                          f"disagree with it)")
    flags, out = gpt_converter(model).import_megatron(
        rest_args, {k: v for k, v in given.items() if k not in moe_names}, tensors,
        flag_names, foreign_mlp=frozenset(prefixes))
    g = {k.replace("-", "_"): v for k, v in flags.items()}
    want = {}
    for prefix in prefixes:
        want.update(_expected(o, prefix, g["hidden_size"],
                              g.get("ffn_hidden_size") or 4 * g["hidden_size"],
                              bool(g.get("swiglu")), bool(g.get("add_bias_linear", True))))
    unused, missing = sorted(set(ours) - set(want)), sorted(set(want) - set(ours))
    if unused or missing:
        raise ConfigError(f"the checkpoint's MoE tensors disagree with its settings "
                          f"(num_experts {o['num_experts']}, moe_layer_freq "
                          f"{o.get('moe_layer_freq', '1')}): unused {unused[:6]}, missing "
                          f"{missing[:6]}")
    for name, shape in want.items():
        if tuple(ours[name].shape) != shape:
            raise ConfigError(f"{name!r} has shape {tuple(ours[name].shape)}; the MoE settings "
                              f"need {shape}")
    out.update(ours)
    flags.update({k.replace("_", "-"): v for k, v in o.items() if k in flag_names})
    return flags, out


# ---------------------------------------------------------------------------------- export

class _Without(Mapping):
    """A lazy view of ``tensors`` without the MoE layers' MLP tensors."""

    def __init__(self, tensors: Mapping):
        self.tensors = tensors
        self.names = [n for n in tensors if not is_moe_key(n)]

    def __getitem__(self, name):
        if is_moe_key(name):
            raise KeyError(name)
        return self.tensors[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def _none_object() -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([None], buf)  # Megatron stores torch.save([data of each shard])
    return buf


def _megatron_prefix(prefix: str) -> str:
    if prefix.startswith("mtp."):
        return prefix.replace(".mtp_model_layer", ".transformer_layer")
    return prefix


def export_megatron(config, tensors: Mapping, padded_vocab: int):
    o, m = config.moe, config.model
    freq = megatron_layer_freq(o.moe_layer_freq, m.num_layers)
    pattern = moe_layer_pattern(o.moe_layer_freq, m.num_layers)
    stacked = freq == 1  # Megatron: an int above 1 or a list saves layer by layer
    depth = getattr(getattr(config, "mtp", None), "mtp_num_layers", None) or 0
    args, out = gpt_converter(selected_driver(config, "model")).export_megatron(
        config, _Without(tensors), padded_vocab, stacked=stacked)
    for name in MOE_ARGS:
        setattr(args, name, getattr(o, name))
    args.moe_layer_freq = freq
    args.num_experts = o.num_experts
    # the keys are the TE spec's (pre_mlp_layernorm kept apart in MoE layers)
    args.transformer_impl = "transformer_engine"
    experts = o.num_experts
    by_layer = {}
    for prefix in moe_prefixes(pattern, depth):
        layer = {}
        names = [n for n in tensors if n.startswith(prefix + ".mlp.") and is_moe_key(n)]
        first = f"{prefix}.mlp.experts.local_experts.0."
        for name in names:
            rest = name[len(prefix) + 1:]
            if name.startswith(f"{prefix}.mlp.experts.local_experts."):
                if name.startswith(first):
                    part = name[len(first):]
                    layer[f"mlp.experts.experts.{part}"] = torch.stack(
                        [tensors[f"{prefix}.mlp.experts.local_experts.{e}.{part}"]
                         for e in range(experts)])
                continue
            layer[rest] = tensors[name]
        by_layer[prefix] = layer
    modules: dict = {}
    for prefix, layer in by_layer.items():
        for rest in layer:
            if rest.endswith(".weight") and ".linear_fc" in rest:
                modules.setdefault(prefix, set()).add(rest[:-len(".weight")])
    none = _none_object()
    decoder = [p for p in by_layer if p.startswith("decoder.")]
    if stacked and decoder:
        for rest in by_layer[decoder[0]]:
            out[f"decoder.layers.{rest}"] = torch.stack([by_layer[p][rest] for p in decoder])
        for module in sorted(modules.get(decoder[0], ())):
            expert = module.startswith("mlp.experts.")
            for i in range(len(decoder)):
                shards = [((i, e), (len(decoder), experts)) for e in range(experts)] \
                    if expert else [((i,), (len(decoder),))]
                for offsets, shape in shards:
                    out[_object_key(f"decoder.layers.{module}", offsets, shape)] = \
                        io.BytesIO(none.getvalue())
    for prefix, layer in by_layer.items():
        if stacked and prefix.startswith("decoder."):
            continue
        mprefix = _megatron_prefix(prefix)
        for rest, t in layer.items():
            out[f"{mprefix}.{rest}"] = t
        for module in sorted(modules.get(prefix, ())):
            expert = module.startswith("mlp.experts.")
            shards = [((e,), (experts,)) for e in range(experts)] if expert else [((0,), (1,))]
            for offsets, shape in shards:
                out[_object_key(f"{mprefix}.{module}", offsets, shape)] = \
                    io.BytesIO(none.getvalue())
    return args, out


def _object_key(module: str, offsets, shape) -> str:
    return (f"{module}._extra_state/shard_{'.'.join(map(str, offsets))}_"
            f"{'.'.join(map(str, shape))}")


class MegatronMoE:
    """Members shared by plugtron-moe's converters (mixed into each): Megatron-Core's, and the
    parts an export may leave out (``--drop mtp``: the MTP layers, as the GPT converter)."""

    model = "gpt"
    droppable_parts = {"mtp": "the multi-token prediction layers"}

    def drop_part(self, config, part: str) -> None:
        mtp = getattr(config, "mtp", None)
        if part == "mtp" and mtp is not None:
            mtp.mtp_num_layers = None

    @classmethod
    def claims_megatron(cls, args: dict | None, given: dict) -> bool:
        """A torch_dist checkpoint with MoE layers: ``num_experts`` saved or given."""
        return bool(given.get("num_experts") or (args or {}).get("num_experts"))

    def import_megatron(self, args, given, tensors, flag_names):
        return import_megatron(self.model, args, given, tensors, flag_names)

    def export_megatron(self, config, tensors, padded_vocab):
        return export_megatron(config, tensors, padded_vocab)
