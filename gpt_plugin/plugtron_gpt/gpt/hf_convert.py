"""Hugging Face <-> plugtron for GPT models (entry point ``gpt`` in ``plugtron.converters``).

Two Hugging Face layouts:

* **The Llama family** (``model_type`` ``llama``, ``mistral``, ``qwen2``, ``qwen3``; their
  differences in hf_families.py): RMSNorm, SwiGLU, rotary positions (rotate-half, as plugtron;
  default, linear or Llama 3.x scaling), grouped-query attention, tied or untied output layer,
  biases (all, none, or q/k/v only), sliding window, Qwen3's per-head q/k norms.
* **GPT-2** (``model_type: gpt2``): LayerNorm, GeLU (``activation_function: gelu`` exact, or
  ``gelu_new`` / ``gelu_pytorch_tanh``, the tanh approximation: ``--openai-gelu``), learned
  positions, biases, tied output layer. GPT-2 stores its linear layers as ``Conv1D``, i.e.
  transposed.

plugtron's names are Megatron-Core's (``decoder.layers.{i}.self_attention.linear_qkv.weight``,
``decoder.final_layernorm.weight``, ...). Its fused QKV weight is laid out per query group,
``[q_1..q_n, k, v]`` for each group (attention.py), and SwiGLU's fc1 is ``[gate; up]``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from plugtron.api import ConfigError, TrainConfig
from plugtron_gpt.gpt import hf_families
from plugtron_gpt.gpt.hf_families import FAMILIES, family_config, family_flags, family_of
from plugtron_gpt.gpt.hf_linears import LlamaLinears, fuse_qkv, split_qkv
from plugtron_gpt.gpt.megatron_convert import export_megatron, import_megatron
from plugtron_gpt.gpt.mtp import DROPPABLE, drop_mtp
from plugtron_gpt.gpt.param_names import EMBEDDING, FINAL_NORM, OUTPUT, POSITIONS
from plugtron_gpt.layers.attention_options import attention_options, parse_window, rope_scaling
from plugtron_gpt.layers.mlp import openai_gelu, squared_relu


def _layer(i: int) -> str:
    """Layer ``i``'s prefix; its norms sit right under it (``{layer}.input_layernorm``)."""
    return f"decoder.layers.{i}"


def _attn(i: int) -> str:
    return f"{_layer(i)}.self_attention"


def _mlp(i: int) -> str:
    return f"{_layer(i)}.mlp"


class _Readable(Protocol):
    def __getitem__(self, name: str) -> torch.Tensor: ...


def _take(tensors: _Readable, name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise ConfigError(f"the Hugging Face weights have no tensor {name!r}") from None


# --------------------------------------------------------------------------- Llama


def llama_from_hf(c: dict, hf: dict) -> tuple[dict, dict]:
    """Any of the Llama family (``c["model_type"]``)."""
    family = c.get("model_type", "llama")
    if c.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{family} hidden_act {c['hidden_act']!r}: plugtron's SwiGLU uses "
                          f"silu")
    extra = family_flags(c, family)
    bias = extra["add-bias-linear"]
    qkv_bias = bias or extra.get("add-qkv-bias", False)
    layers, hidden = c["num_hidden_layers"], c["hidden_size"]
    heads = c["num_attention_heads"]
    groups = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    tied = bool(c.get("tie_word_embeddings", False))
    flags = {"num-layers": layers, "hidden-size": hidden,
             "ffn-hidden-size": c["intermediate_size"], "num-attention-heads": heads,
             "num-query-groups": groups, "kv-channels": head_dim, "vocab-size": c["vocab_size"],
             "position-embedding-type": "rope",
             "normalization": "RMSNorm", "norm-epsilon": c.get("rms_norm_eps", 1e-6),
             "swiglu": True, "untie-embeddings-and-output-weights": not tied,
             "hidden-dropout": 0.0,  # Llama has no residual dropout
             "attention-dropout": float(c.get("attention_dropout", 0.0))} | extra
    if c.get("max_position_embeddings"):
        flags["max-position-embeddings"] = c["max_position_embeddings"]
    out = {EMBEDDING: _take(hf, "model.embed_tokens.weight"),
           f"{FINAL_NORM}.weight": _take(hf, "model.norm.weight")}
    if not tied:
        out[OUTPUT] = _take(hf, "lm_head.weight")
    for i in range(layers):
        src = f"model.layers.{i}"
        layer, a, m = _layer(i), _attn(i), _mlp(i)
        out[f"{layer}.input_layernorm.weight"] = _take(hf, f"{src}.input_layernorm.weight")
        out[f"{layer}.pre_mlp_layernorm.weight"] = _take(hf,
                                                         f"{src}.post_attention_layernorm.weight")
        for kind in ("weight", "bias") if qkv_bias else ("weight",):
            q, k, v = (_take(hf, f"{src}.self_attn.{p}_proj.{kind}") for p in "qkv")
            out[f"{a}.linear_qkv.{kind}"] = fuse_qkv(q, k, v, heads, groups)
        if extra.get("qk-layernorm"):
            out[f"{a}.q_layernorm.weight"] = _take(hf, f"{src}.self_attn.q_norm.weight")
            out[f"{a}.k_layernorm.weight"] = _take(hf, f"{src}.self_attn.k_norm.weight")
        for kind in ("weight", "bias") if bias else ("weight",):
            out[f"{a}.linear_proj.{kind}"] = _take(hf, f"{src}.self_attn.o_proj.{kind}")
            out[f"{m}.linear_fc1.{kind}"] = torch.cat([_take(hf, f"{src}.mlp.gate_proj.{kind}"),
                                                       _take(hf, f"{src}.mlp.up_proj.{kind}")])
            out[f"{m}.linear_fc2.{kind}"] = _take(hf, f"{src}.mlp.down_proj.{kind}")
    return flags, out


def llama_to_hf(config, t: dict) -> tuple[dict, dict]:
    """The Llama-family member :func:`family_of` picks for ``config``."""
    m = config.model
    family = family_of(config)
    qkv_bias = m.add_bias_linear or attention_options(config).add_qkv_bias
    qk_norm = attention_options(config).qk_layernorm
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    head_dim = m.kv_channels or m.hidden_size // heads
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    tied = not m.untie_embeddings_and_output_weights
    hf_config = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
                 "intermediate_size": ffn, "num_hidden_layers": m.num_layers,
                 "num_attention_heads": heads, "num_key_value_heads": groups,
                 "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": m.norm_epsilon,
                 "max_position_embeddings": m.max_position_embeddings or m.seq_length,
                 "tie_word_embeddings": tied, "attention_dropout": m.attention_dropout,
                 **family_config(config, family)}
    out = {"model.embed_tokens.weight": t[EMBEDDING],
           "model.norm.weight": t[f"{FINAL_NORM}.weight"]}
    if not tied:
        out["lm_head.weight"] = t[OUTPUT]
    for i in range(m.num_layers):
        dst = f"model.layers.{i}"
        layer, a, p = _layer(i), _attn(i), _mlp(i)
        out[f"{dst}.input_layernorm.weight"] = t[f"{layer}.input_layernorm.weight"]
        out[f"{dst}.post_attention_layernorm.weight"] = t[f"{layer}.pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias") if qkv_bias else ("weight",):
            q, k, v = split_qkv(t[f"{a}.linear_qkv.{kind}"], heads, groups)
            out[f"{dst}.self_attn.q_proj.{kind}"] = q
            out[f"{dst}.self_attn.k_proj.{kind}"] = k
            out[f"{dst}.self_attn.v_proj.{kind}"] = v
        if qk_norm:
            out[f"{dst}.self_attn.q_norm.weight"] = t[f"{a}.q_layernorm.weight"]
            out[f"{dst}.self_attn.k_norm.weight"] = t[f"{a}.k_layernorm.weight"]
        for kind in ("weight", "bias") if m.add_bias_linear else ("weight",):
            out[f"{dst}.self_attn.o_proj.{kind}"] = t[f"{a}.linear_proj.{kind}"]
            gate, up = t[f"{p}.linear_fc1.{kind}"].chunk(2)
            out[f"{dst}.mlp.gate_proj.{kind}"] = gate
            out[f"{dst}.mlp.up_proj.{kind}"] = up
            out[f"{dst}.mlp.down_proj.{kind}"] = t[f"{p}.linear_fc2.{kind}"]
    return hf_config, out


# --------------------------------------------------------------------------- GPT-2


#: GPT-2's activation_function -> --openai-gelu (the tanh approximation, two spellings).
GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


class _Unprefixed:
    """``hf`` read with or without GPT-2's ``transformer.`` prefix (GPT2LMHeadModel writes it,
    GPT2Model does not). Reads go through to ``hf`` so the core sees which tensors were used."""

    def __init__(self, hf, prefix: str):
        self.hf, self.prefix = hf, prefix

    def _name(self, name: str) -> str:
        return self.prefix + name if self.prefix + name in self.hf else name

    def __contains__(self, name) -> bool:
        return self._name(name) in self.hf

    def __getitem__(self, name):
        return self.hf[self._name(name)]


def gpt2_from_hf(c: dict, hf: dict) -> tuple[dict, dict]:
    act = c.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise ConfigError(f"GPT-2 activation_function {act!r} is not supported: plugtron "
                          f"converts {', '.join(sorted(GPT2_ACTIVATIONS))}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if c.get(flag):
            raise ConfigError(f"GPT-2 {flag}=true is not supported by plugtron")
    if not c.get("tie_word_embeddings", True):
        raise ConfigError("an untied GPT-2 is not a GPT-2 layout plugtron converts")
    unprefixed = _Unprefixed(hf, "transformer.")
    layers, hidden, heads = c["n_layer"], c["n_embd"], c["n_head"]
    flags = {"num-layers": layers, "hidden-size": hidden,
             "ffn-hidden-size": c.get("n_inner") or 4 * hidden, "num-attention-heads": heads,
             "vocab-size": c["vocab_size"], "position-embedding-type": "learned_absolute",
             "openai-gelu": GPT2_ACTIVATIONS[act],
             "max-position-embeddings": c["n_positions"], "normalization": "LayerNorm",
             "norm-epsilon": c.get("layer_norm_epsilon", 1e-5), "swiglu": False,
             "untie-embeddings-and-output-weights": False, "add-bias-linear": True,
             "hidden-dropout": float(c.get("resid_pdrop", 0.1)),
             "attention-dropout": float(c.get("attn_pdrop", 0.1))}
    out = {EMBEDDING: _take(unprefixed, "wte.weight"), POSITIONS: _take(unprefixed, "wpe.weight"),
           f"{FINAL_NORM}.weight": _take(unprefixed, "ln_f.weight"),
           f"{FINAL_NORM}.bias": _take(unprefixed, "ln_f.bias")}
    for i in range(layers):
        src, layer, a, m = f"h.{i}", _layer(i), _attn(i), _mlp(i)
        for kind in ("weight", "bias"):
            out[f"{layer}.input_layernorm.{kind}"] = _take(unprefixed, f"{src}.ln_1.{kind}")
            out[f"{layer}.pre_mlp_layernorm.{kind}"] = _take(unprefixed, f"{src}.ln_2.{kind}")
        # Conv1D weights are [in, out]: transpose to a linear layer's [out, in].
        q, k, v = _take(unprefixed, f"{src}.attn.c_attn.weight").t().chunk(3)
        out[f"{a}.linear_qkv.weight"] = fuse_qkv(q, k, v, heads, heads)
        q, k, v = _take(unprefixed, f"{src}.attn.c_attn.bias").chunk(3)
        out[f"{a}.linear_qkv.bias"] = fuse_qkv(q, k, v, heads, heads)
        out[f"{a}.linear_proj.weight"] = _take(unprefixed, f"{src}.attn.c_proj.weight").t()
        out[f"{a}.linear_proj.bias"] = _take(unprefixed, f"{src}.attn.c_proj.bias")
        out[f"{m}.linear_fc1.weight"] = _take(unprefixed, f"{src}.mlp.c_fc.weight").t()
        out[f"{m}.linear_fc1.bias"] = _take(unprefixed, f"{src}.mlp.c_fc.bias")
        out[f"{m}.linear_fc2.weight"] = _take(unprefixed, f"{src}.mlp.c_proj.weight").t()
        out[f"{m}.linear_fc2.bias"] = _take(unprefixed, f"{src}.mlp.c_proj.bias")
    return flags, out


def gpt2_to_hf(config, t: dict) -> tuple[dict, dict]:
    m = config.model
    heads = m.num_attention_heads
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "vocab_size": m.vocab_size, "n_embd": m.hidden_size, "n_layer": m.num_layers,
              "n_head": heads, "n_inner": m.ffn_hidden_size or 4 * m.hidden_size,
              "n_positions": m.max_position_embeddings or m.seq_length,
              "activation_function": "gelu_new" if openai_gelu(config) else "gelu",
              "layer_norm_epsilon": m.norm_epsilon,
              "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout,
              "attn_pdrop": m.attention_dropout, "tie_word_embeddings": True,
              "scale_attn_weights": True}
    out = {"transformer.wte.weight": t[EMBEDDING], "transformer.wpe.weight": t[POSITIONS],
           "transformer.ln_f.weight": t[f"{FINAL_NORM}.weight"],
           "transformer.ln_f.bias": t[f"{FINAL_NORM}.bias"]}
    for i in range(m.num_layers):
        dst, layer, a, p = f"transformer.h.{i}", _layer(i), _attn(i), _mlp(i)
        for kind in ("weight", "bias"):
            out[f"{dst}.ln_1.{kind}"] = t[f"{layer}.input_layernorm.{kind}"]
            out[f"{dst}.ln_2.{kind}"] = t[f"{layer}.pre_mlp_layernorm.{kind}"]
        out[f"{dst}.attn.c_attn.weight"] = torch.cat(
            split_qkv(t[f"{a}.linear_qkv.weight"], heads, heads)).t()
        out[f"{dst}.attn.c_attn.bias"] = torch.cat(split_qkv(t[f"{a}.linear_qkv.bias"], heads,
                                                             heads))
        out[f"{dst}.attn.c_proj.weight"] = t[f"{a}.linear_proj.weight"].t()
        out[f"{dst}.attn.c_proj.bias"] = t[f"{a}.linear_proj.bias"]
        out[f"{dst}.mlp.c_fc.weight"] = t[f"{p}.linear_fc1.weight"].t()
        out[f"{dst}.mlp.c_fc.bias"] = t[f"{p}.linear_fc1.bias"]
        out[f"{dst}.mlp.c_proj.weight"] = t[f"{p}.linear_fc2.weight"].t()
        out[f"{dst}.mlp.c_proj.bias"] = t[f"{p}.linear_fc2.bias"]
    return config, out


# --------------------------------------------------------------------------- the converter


def hf_layout_of(config) -> str:
    """Which Hugging Face layout a plugtron GPT run config is, or ConfigError saying why
    none."""
    m = config.model
    groups = m.num_query_groups or m.num_attention_heads
    if attention_options(config).multi_latent_attention:
        raise ConfigError("--multi-latent-attention exports as deepseek_v3 (plugtron-moe), "
                          "whose layers after first_k_dense_replace are MoE: a dense MLA "
                          "model (no --num-experts) matches no Hugging Face layout")
    if getattr(getattr(config, "mtp", None), "mtp_num_layers", None):
        raise ConfigError("--mtp-num-layers: the Hugging Face layout with multi-token "
                          "prediction layers is deepseek_v3 (--multi-latent-attention with "
                          "--num-experts); this model matches none")
    if m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope":
        return family_of(config)
    if squared_relu(config):
        raise ConfigError("--squared-relu matches no Hugging Face layout plugtron exports")
    o = attention_options(config)
    for flag, value in (("--qk-layernorm", o.qk_layernorm), ("--add-qkv-bias", o.add_qkv_bias),
                        ("--window-size", parse_window(o.window_size) is not None),
                        ("rotary scaling", rope_scaling(config) is not None)):
        if value and m.position_embedding_type == "learned_absolute":
            raise ConfigError(f"{flag} is exported in the Llama family only (RMSNorm + "
                              f"--swiglu + rope); GPT-2 has no such option")
    if (m.normalization == "LayerNorm" and not m.swiglu
            and m.position_embedding_type == "learned_absolute" and m.add_bias_linear
            and not m.untie_embeddings_and_output_weights and groups == m.num_attention_heads
            and (m.kv_channels or m.hidden_size // m.num_attention_heads)
            == m.hidden_size // m.num_attention_heads):
        return "gpt2"
    raise ConfigError(
        "this model matches no Hugging Face layout plugtron exports: the Llama family needs "
        "RMSNorm + "
        "--swiglu + rope; GPT-2 needs LayerNorm, GeLU, learned positions, biases, tied "
        f"embeddings and one group per head (model: {m.normalization}, swiglu {m.swiglu}, "
        f"{m.position_embedding_type}, bias {m.add_bias_linear}, untied "
        f"{m.untie_embeddings_and_output_weights}, groups {groups})")


class GPTConverter:
    #: what ``plugtron convert import-hf`` finds this converter by (config.json's model_type)
    model_types = (*FAMILIES, "gpt2")
    vocab_tensors = (EMBEDDING, OUTPUT)
    droppable_parts = DROPPABLE
    #: Buffers some files still hold that carry no weights (GPT-2's causal mask, old Llama
    #: files' rotary frequencies): the strict import accepts them unread.
    ignored_hf_tensors = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",
                          r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

    def drop_part(self, config, part: str) -> None:
        drop_mtp(config, part)

    def hf_linear_map(self, config) -> LlamaLinears:
        """Each layer's four linears as Llama's modules (PEFT adapters)."""
        if hf_layout_of(config) == "gpt2":
            raise ConfigError("GPT-2 keeps its linears as transposed Conv1D modules (fused "
                              "c_attn): PEFT adapters are written and read for the Llama "
                              "family's layout only")
        m = config.model
        modules = {}
        for i in range(m.num_layers):
            dst, a, p = f"model.layers.{i}", _attn(i), _mlp(i)
            modules[f"{a}.linear_qkv"] = [f"{dst}.self_attn.{x}_proj" for x in "qkv"]
            modules[f"{a}.linear_proj"] = [f"{dst}.self_attn.o_proj"]
            modules[f"{p}.linear_fc1"] = [f"{dst}.mlp.gate_proj", f"{dst}.mlp.up_proj"]
            modules[f"{p}.linear_fc2"] = [f"{dst}.mlp.down_proj"]
        return LlamaLinears(modules, m.num_attention_heads,
                            m.num_query_groups or m.num_attention_heads)

    # Shared with the converters of models that extend gpt (plugtron-moe's, which reach them
    # through the registry): one reading of HF's rotary settings, one writing of them.
    @staticmethod
    def hf_rope_flags(hf_config: dict, mla: bool = False) -> dict:
        """config.json's rotary settings -> plugtron flags (YaRN's, under MLA too)."""
        return hf_families.rope_flags(hf_config, mla)

    @staticmethod
    def hf_rope_config(config) -> dict:
        """A run config's ``rope_theta`` and ``rope_parameters`` for config.json."""
        return hf_families.rope_config(config)

    def import_hf(self, hf_config: dict, tensors: dict) -> tuple[dict, dict]:
        kind = hf_config.get("model_type")
        if kind in FAMILIES:
            return llama_from_hf(hf_config, tensors)
        if kind == "gpt2":
            return gpt2_from_hf(hf_config, tensors)
        raise ConfigError(f"Hugging Face model_type {kind!r} is not supported; the gpt "
                          f"converter reads {', '.join(FAMILIES)} and gpt2")

    def export_hf(self, model_config, tensors: dict, config=None) -> tuple[dict, dict]:
        if config is None:  # a caller with the model section only: no plugin options

            config = TrainConfig()
            config.model = model_config
        if squared_relu(config):
            # Llama's MLP is gated SiLU, GPT-2's GeLU: writing either would silently change
            # what the weights compute.
            raise ConfigError(
                "--squared-relu: this GPT model's MLP is relu(x)^2 (non-gated), which neither "
                "Llama (gated SiLU) nor GPT-2 (GeLU) can express; transformers' NemotronH "
                "(hidden_act relu2) has it: train a --model hybrid with a pattern of * and - "
                "layers and export that, or train without --squared-relu")
        if hf_layout_of(config) == "gpt2":
            return gpt2_to_hf(config, tensors)
        return llama_to_hf(config, tensors)

    # Megatron-Core torch_dist checkpoints (core/interchange/megatron.py calls these).
    # A converter extending the model (plugtron-moe's) passes ``foreign_mlp`` / ``stacked``
    # (see megatron_convert.py).
    def import_megatron(self, args, given, tensors, flag_names, foreign_mlp=frozenset()):
        return import_megatron(args, given, tensors, flag_names, foreign_mlp)

    def export_megatron(self, config, tensors, padded_vocab, stacked=None):
        return export_megatron(config, tensors, padded_vocab, stacked)
