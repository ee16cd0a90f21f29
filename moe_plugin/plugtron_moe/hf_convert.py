"""Hugging Face <-> plugtron for MoE models on the ``gpt`` model (entry points ``mixtral`` and
``qwen2_moe`` in ``plugtron.converters``; the second also reads ``qwen3_moe``).

* **Mixtral** (``model_type: mixtral``): Llama attention, every layer MoE, softmax top-k
  renormalised (= Megatron's post-softmax top-k), SwiGLU experts, no biases.
* **Qwen2-MoE** (``model_type: qwen2_moe``): biases on q/k/v only, top-k renormalised only with
  ``norm_topk_prob`` (else Megatron's pre-softmax routing), a shared expert with a sigmoid gate
  ``shared_expert_gate [1, H]``, dense layers by ``decoder_sparse_step`` / ``mlp_only_layers``.
  The q/k/v biases are the GPT model's ``--add-qkv-bias`` (no other linear layer has one).
  Checkpoints imported before that option held zero biases elsewhere; export still takes them
  and refuses them once nonzero.
* **Qwen3-MoE** (``model_type: qwen3_moe``): as Qwen2-MoE without the shared expert and the
  q/k/v biases, with per-head q/k RMSNorm (``q_norm`` / ``k_norm``: ``--qk-layernorm``,
  ``self_attention.{q,k}_layernorm.weight``).

Rotary position: plain, or YaRN (``rope_type: yarn``: ``--rope-type yarn`` and its options;
hf_rope.py); other scalings are refused by name.

transformers 5 stores experts fused: ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first,
as plugtron's SwiGLU ``linear_fc1 = [gate; up]``), ``mlp.experts.down_proj [E, H, I]``, router
``mlp.gate.weight [E, H]``. plugtron's per-expert tensors are
``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``.
"""

from __future__ import annotations

import torch
from plugtron.api import ConfigError, selected_driver

from .hf_rope import rope_config, rope_flags
from .megatron_convert import MegatronMoE
from .options import moe_layer_pattern, uses_sinkhorn

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


def _take(hf: dict, name: str) -> torch.Tensor:
    try:
        return hf[name]
    except KeyError:
        raise ConfigError(f"the Hugging Face weights have no tensor {name!r}") from None


# plugtron's fused QKV is laid out per query group, [q_1..q_n, k, v] per group (the GPT
# plugin's attention); repeated here because a plugin does not import another's internals.
def fuse_qkv(q, k, v, heads: int, groups: int) -> torch.Tensor:
    rest, d, per = tuple(q.shape[1:]), q.shape[0] // heads, heads // groups
    parts = [q.reshape(groups, per, d, *rest), k.reshape(groups, 1, d, *rest),
             v.reshape(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(groups * (per + 2) * d, *rest)


def split_qkv(qkv, heads: int, groups: int):
    rest, per = tuple(qkv.shape[1:]), heads // groups
    d = qkv.shape[0] // (groups * (per + 2))
    x = qkv.reshape(groups, per + 2, d, *rest)
    return (x[:, :per].reshape(heads * d, *rest), x[:, per].reshape(groups * d, *rest),
            x[:, per + 1].reshape(groups * d, *rest))


#: Attention flags of the Qwen MoE families (the GPT model's `*` layer options).
_QWEN_ATTENTION = {"qwen2_moe": {"add-bias-linear": False, "add-qkv-bias": True},
                   "qwen3_moe": {"add-bias-linear": False, "qk-layernorm": True}}


def _attention_options(config):
    """``(add_qkv_bias, qk_layernorm)`` of a run config (False where it has no such section)."""
    options = getattr(config, "attention", None)
    return (bool(getattr(options, "add_qkv_bias", False)),
            bool(getattr(options, "qk_layernorm", False)))


def _num_experts(c: dict) -> int:
    """Experts per MoE layer: ``num_experts`` or ``num_local_experts`` (the name transformers 5
    writes for Qwen3-MoE, whose config maps one to the other)."""
    value = c.get("num_experts", c.get("num_local_experts"))
    if value is None:
        raise ConfigError("config.json has neither 'num_experts' nor 'num_local_experts'")
    return value


def _sparse_layers(kind: str, c: dict) -> list[bool]:
    layers = c["num_hidden_layers"]
    if kind == "mixtral":
        return [True] * layers
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    return [i not in dense and _num_experts(c) > 0 and (i + 1) % step == 0
            for i in range(layers)]


#: Per-expert names files still use (transformers 5 writes them on save_pretrained and the hub
#: holds them): module prefix, and the (gate, up, down) weight names.
_LEGACY_EXPERTS = (("block_sparse_moe", ("w1", "w3", "w2")),  # Mixtral
                   ("mlp", ("gate_proj", "up_proj", "down_proj")))  # Qwen2-MoE


def fused_experts(hf: dict, src: str, experts: int):
    """``(router [E, H], gate_up [E, 2I, H], down [E, H, I])`` of layer ``src`` from the fused
    transformers-5 tensors or from the per-expert ones, whichever the file has."""
    if f"{src}.mlp.experts.gate_up_proj" in hf:
        return (_take(hf, f"{src}.mlp.gate.weight"), hf[f"{src}.mlp.experts.gate_up_proj"],
                _take(hf, f"{src}.mlp.experts.down_proj"))
    for module, (gate, up, down) in _LEGACY_EXPERTS:
        base = f"{src}.{module}"
        if f"{base}.experts.0.{gate}.weight" in hf:
            return (_take(hf, f"{base}.gate.weight"),
                    torch.stack([torch.cat([_take(hf, f"{base}.experts.{e}.{gate}.weight"),
                                            _take(hf, f"{base}.experts.{e}.{up}.weight")])
                                 for e in range(experts)]),
                    torch.stack([_take(hf, f"{base}.experts.{e}.{down}.weight")
                                 for e in range(experts)]))
    raise ConfigError(f"the Hugging Face weights have no experts for {src}")


class MoEConverter(MegatronMoE):
    """Reads and writes Mixtral and Qwen2-MoE; the checkpoint runs on the ``gpt`` model."""

    model = "gpt"
    model_types = ("mixtral", "qwen2_moe", "qwen3_moe")
    vocab_tensors = (EMBEDDING, OUTPUT)

    @classmethod
    def handles(cls, config) -> bool:
        moe = getattr(config, "moe", None)
        mla = getattr(getattr(config, "attention", None), "multi_latent_attention", False)
        # with multi-latent attention: DeepSeek-V3 (hf_deepseek.py)
        return selected_driver(config, "model") == "gpt" and bool(moe and moe.num_experts) and not mla

    # ------------------------------------------------------------------ import

    def import_hf(self, c: dict, hf: dict) -> tuple[dict, dict]:
        kind = c.get("model_type")
        if kind not in self.model_types:
            raise ConfigError(f"model_type {kind!r}: this converter reads {self.model_types}")
        if c.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {c['hidden_act']!r}: plugtron's SwiGLU uses silu")
        if c.get("use_sliding_window"):
            raise ConfigError("sliding-window attention is not supported by plugtron")
        qwen = kind in _QWEN_ATTENTION
        shared = kind == "qwen2_moe"
        if kind == "qwen3_moe" and c.get("attention_bias"):
            raise ConfigError("qwen3_moe attention_bias=true puts a bias on o_proj but not on "
                              "the MLPs; plugtron has one --add-bias-linear for every linear "
                              "layer")
        layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
        groups = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        experts = _num_experts(c)
        sparse = _sparse_layers(kind, c)
        tied = bool(c.get("tie_word_embeddings", False))
        moe_ffn = c["moe_intermediate_size"] if qwen else c["intermediate_size"]
        flags = {"num-layers": layers, "hidden-size": hidden,
                 "ffn-hidden-size": c["intermediate_size"], "num-attention-heads": heads,
                 "num-query-groups": groups, "kv-channels": head_dim,
                 "vocab-size": c["vocab_size"], "position-embedding-type": "rope",
                 **rope_flags(c), "normalization": "RMSNorm",
                 "norm-epsilon": c.get("rms_norm_eps", 1e-6), "swiglu": True,
                 "untie-embeddings-and-output-weights": not tied, "add-bias-linear": False,
                 "attention-dropout": float(c.get("attention_dropout", 0.0)),
                 "hidden-dropout": 0.0,  # Mixtral and Qwen2-MoE have no residual dropout
                 "num-experts": experts, "moe-router-topk": c["num_experts_per_tok"],
                 "moe-ffn-hidden-size": moe_ffn,
                 "moe-layer-freq": "[" + ",".join(str(int(s)) for s in sparse) + "]",
                 "moe-aux-loss-coeff": float(c.get("router_aux_loss_coef", 0.0))
                 if c.get("output_router_logits") else 0.0}
        if qwen:
            flags.update(_QWEN_ATTENTION[kind])
            flags["moe-router-pre-softmax"] = not c.get("norm_topk_prob", False)
        if shared:
            flags["moe-shared-expert-intermediate-size"] = c["shared_expert_intermediate_size"]
            flags["moe-shared-expert-gate"] = True
        if c.get("max_position_embeddings"):
            flags["max-position-embeddings"] = c["max_position_embeddings"]
        out = {EMBEDDING: _take(hf, "model.embed_tokens.weight"),
               "decoder.final_layernorm.weight": _take(hf, "model.norm.weight")}
        if not tied:
            out[OUTPUT] = _take(hf, "lm_head.weight")
        for i in range(layers):
            out.update(self._layer_from_hf(i, hf, heads, groups, kind, sparse[i], experts))
        return flags, out

    def _layer_from_hf(self, i, hf, heads, groups, kind, sparse, experts) -> dict:
        src, dst = f"model.layers.{i}", f"decoder.layers.{i}"
        out = {f"{dst}.input_layernorm.weight": _take(hf, f"{src}.input_layernorm.weight"),
               f"{dst}.pre_mlp_layernorm.weight": _take(hf,
                                                        f"{src}.post_attention_layernorm.weight")}
        a = f"{dst}.self_attention"
        q, k, v = (_take(hf, f"{src}.self_attn.{p}_proj.weight") for p in "qkv")
        out[f"{a}.linear_qkv.weight"] = fuse_qkv(q, k, v, heads, groups)
        out[f"{a}.linear_proj.weight"] = _take(hf, f"{src}.self_attn.o_proj.weight")
        if kind == "qwen2_moe":
            q, k, v = (_take(hf, f"{src}.self_attn.{p}_proj.bias") for p in "qkv")
            out[f"{a}.linear_qkv.bias"] = fuse_qkv(q, k, v, heads, groups)
        if kind == "qwen3_moe":
            out[f"{a}.q_layernorm.weight"] = _take(hf, f"{src}.self_attn.q_norm.weight")
            out[f"{a}.k_layernorm.weight"] = _take(hf, f"{src}.self_attn.k_norm.weight")
        m = f"{dst}.mlp"

        def mlp(prefix, names, hf_prefix):
            w1 = torch.cat([_take(hf, f"{hf_prefix}.gate_proj.weight"),
                            _take(hf, f"{hf_prefix}.up_proj.weight")])
            names[f"{prefix}.linear_fc1.weight"] = w1
            names[f"{prefix}.linear_fc2.weight"] = _take(hf, f"{hf_prefix}.down_proj.weight")

        if not sparse:
            mlp(m, out, f"{src}.mlp")
            return out
        router, gate_up, down = fused_experts(hf, src, experts)
        out[f"{m}.router.weight"] = router
        for e in range(experts):
            prefix = f"{m}.experts.local_experts.{e}"
            out[f"{prefix}.linear_fc1.weight"] = gate_up[e]
            out[f"{prefix}.linear_fc2.weight"] = down[e]
        if kind == "qwen2_moe":
            mlp(f"{m}.shared_experts", out, f"{src}.mlp.shared_expert")
            out[f"{m}.shared_experts.gate_weight"] = _take(hf,
                                                           f"{src}.mlp.shared_expert_gate.weight")
        return out

    # ------------------------------------------------------------------ export

    def export_hf(self, model_config, tensors):
        raise ConfigError("the MoE converter needs the run config: use export_hf_from")

    def export_hf_from(self, config, t: dict) -> tuple[dict, dict]:
        m, o = config.model, config.moe
        if getattr(getattr(config, "attention", None), "multi_latent_attention", False):
            raise ConfigError("--multi-latent-attention with experts exports as deepseek_v3 "
                              "(its converter, not this one)")
        if getattr(getattr(config, "mtp", None), "mtp_num_layers", None):
            raise ConfigError("--mtp-num-layers: Mixtral and Qwen-MoE have no multi-token "
                              "prediction layers; DeepSeek-V3 has (--multi-latent-attention)")
        qkv_bias, qk_norm = _attention_options(config)
        kind = ("qwen3_moe" if qk_norm else "qwen2_moe" if o.moe_shared_expert_intermediate_size
                else "mixtral")
        qwen = kind != "mixtral"
        heads = m.num_attention_heads
        groups = m.num_query_groups or heads
        head_dim = m.kv_channels or m.hidden_size // heads
        sparse = moe_layer_pattern(o.moe_layer_freq, m.num_layers)
        moe_ffn = o.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
        if not (m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope"):
            raise ConfigError("Mixtral/Qwen2-MoE export needs RMSNorm + --swiglu + rope")
        if o.moe_router_score_function != "softmax" or o.moe_router_topk_scaling_factor:
            raise ConfigError("Mixtral/Qwen2-MoE route with plain softmax top-k")
        if uses_sinkhorn(o):
            raise ConfigError("Mixtral/Qwen2-MoE route with plain softmax top-k; this model was "
                              "trained with --moe-router-load-balancing-type sinkhorn, whose "
                              "weights (softmax over all experts, sigmoid for top-1) the "
                              "export would not keep")
        config_json = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
                       "num_hidden_layers": m.num_layers, "num_attention_heads": heads,
                       "num_key_value_heads": groups, "head_dim": head_dim,
                       "hidden_act": "silu", "rms_norm_eps": m.norm_epsilon,
                       **rope_config(config),
                       "max_position_embeddings": m.max_position_embeddings or m.seq_length,
                       "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
                       "num_experts_per_tok": o.moe_router_topk,
                       "attention_dropout": m.attention_dropout}
        if kind == "qwen3_moe" and (m.add_bias_linear or qkv_bias
                                    or o.moe_shared_expert_intermediate_size):
            raise ConfigError("--qk-layernorm exports as Qwen3-MoE, which has no biases and no "
                              "shared expert")
        if kind == "qwen2_moe" and not (qkv_bias or m.add_bias_linear):
            raise ConfigError("a shared expert exports as Qwen2-MoE, which has q/k/v biases: "
                              "the model needs --add-qkv-bias")
        if qwen:
            dense = [i for i, s in enumerate(sparse) if not s]
            config_json.update({"architectures": ["Qwen2MoeForCausalLM" if kind == "qwen2_moe"
                                                  else "Qwen3MoeForCausalLM"],
                                "model_type": kind, "num_experts": o.num_experts,
                                "moe_intermediate_size": moe_ffn,
                                "intermediate_size": m.ffn_hidden_size or 4 * m.hidden_size,
                                "norm_topk_prob": not o.moe_router_pre_softmax,
                                "decoder_sparse_step": 1, "mlp_only_layers": dense})
            if kind == "qwen2_moe":
                config_json.update({"shared_expert_intermediate_size":
                                    o.moe_shared_expert_intermediate_size, "qkv_bias": True})
            else:
                config_json["attention_bias"] = False
        else:
            if qkv_bias:
                raise ConfigError("Mixtral has no q/k/v biases (--add-qkv-bias)")
            if not all(sparse) or o.moe_router_pre_softmax or m.add_bias_linear:
                raise ConfigError("Mixtral export needs every layer MoE, post-softmax top-k and "
                                  "no biases")
            config_json.update({"architectures": ["MixtralForCausalLM"],
                                "model_type": "mixtral", "num_local_experts": o.num_experts,
                                "intermediate_size": moe_ffn})
        out = {"model.embed_tokens.weight": t[EMBEDDING],
               "model.norm.weight": t["decoder.final_layernorm.weight"]}
        if m.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = t[OUTPUT]
        for i in range(m.num_layers):
            out.update(self._layer_to_hf(i, t, heads, groups, kind, sparse[i], o.num_experts))
        return config_json, out

    def _layer_to_hf(self, i, t, heads, groups, kind, sparse, experts) -> dict:
        src, dst = f"decoder.layers.{i}", f"model.layers.{i}"
        a, m = f"{src}.self_attention", f"{src}.mlp"

        def no_bias(name):
            # (meta tensors: the core's strict import exports shapes only)
            if name in t and not t[name].is_meta and t[name].abs().max() > 0:
                raise ConfigError(f"{name} is nonzero, but {kind} has no bias there")

        out = {f"{dst}.input_layernorm.weight": t[f"{src}.input_layernorm.weight"],
               f"{dst}.post_attention_layernorm.weight": t[f"{src}.pre_mlp_layernorm.weight"]}
        for p, value in zip("qkv", split_qkv(t[f"{a}.linear_qkv.weight"], heads, groups)):
            out[f"{dst}.self_attn.{p}_proj.weight"] = value
        out[f"{dst}.self_attn.o_proj.weight"] = t[f"{a}.linear_proj.weight"]
        if kind == "qwen2_moe":
            for p, value in zip("qkv", split_qkv(t[f"{a}.linear_qkv.bias"], heads, groups)):
                out[f"{dst}.self_attn.{p}_proj.bias"] = value
        if kind == "qwen3_moe":
            out[f"{dst}.self_attn.q_norm.weight"] = t[f"{a}.q_layernorm.weight"]
            out[f"{dst}.self_attn.k_norm.weight"] = t[f"{a}.k_layernorm.weight"]
        no_bias(f"{a}.linear_proj.bias")

        def mlp(prefix, hf_prefix):
            gate, up = t[f"{prefix}.linear_fc1.weight"].chunk(2)
            out[f"{hf_prefix}.gate_proj.weight"], out[f"{hf_prefix}.up_proj.weight"] = gate, up
            out[f"{hf_prefix}.down_proj.weight"] = t[f"{prefix}.linear_fc2.weight"]
            for kind in ("linear_fc1", "linear_fc2"):
                no_bias(f"{prefix}.{kind}.bias")

        if not sparse:
            mlp(m, f"{dst}.mlp")
            return out
        out[f"{dst}.mlp.gate.weight"] = t[f"{m}.router.weight"]
        per = [f"{m}.experts.local_experts.{e}" for e in range(experts)]
        out[f"{dst}.mlp.experts.gate_up_proj"] = torch.stack([t[f"{p}.linear_fc1.weight"]
                                                              for p in per])
        out[f"{dst}.mlp.experts.down_proj"] = torch.stack([t[f"{p}.linear_fc2.weight"]
                                                           for p in per])
        for p in per:
            no_bias(f"{p}.linear_fc1.bias")
            no_bias(f"{p}.linear_fc2.bias")
        if kind == "qwen2_moe":
            mlp(f"{m}.shared_experts", f"{dst}.mlp.shared_expert")
            out[f"{dst}.mlp.shared_expert_gate.weight"] = t[f"{m}.shared_experts.gate_weight"]
        return out
