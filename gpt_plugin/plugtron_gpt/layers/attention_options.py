"""Options of the attention layer type ``*`` (Megatron's flag names), its config section
``attention``: bias on q/k/v only, per-head q/k norms, sliding windows and rotary scaling.

Declared by the layer type itself (as the MLP's ``--squared-relu``), so every model composing
``*`` has them; code reads them through :func:`attention_options`, which gives the defaults
where a config was built without the section (an old checkpoint, a model without ``*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plugtron.api import ConfigError, ConfigSection, opt, selected_driver


@dataclass
class AttentionOptions:
    add_qkv_bias: bool = opt(False, "--add-qkv-bias",
                             "Bias on the q, k, v projection even without --add-bias-linear "
                             "(Qwen2).", is_flag=True)
    qk_layernorm: bool = opt(False, "--qk-layernorm",
                             "Norm (--normalization) of each query and key head over its "
                             "channels before rotary (Qwen3).", is_flag=True)
    window_size: str | None = opt(
        None, "--window-size",
        "Sliding-window attention as Megatron's (left, right): a query at i sees keys "
        "i-left..i. 'LEFT' or 'LEFT,0' (right must be 0: causal). Hugging Face's "
        "sliding_window W is left W-1. Default: every earlier key.")
    use_rope_scaling: bool = opt(False, "--use-rope-scaling",
                                 "Llama 3.x rotary frequency scaling (the four options below).",
                                 is_flag=True)
    rope_scaling_factor: float = opt(8.0, "--rope-scaling-factor",
                                     "Llama 3.x: low frequencies are divided by this.")
    rope_scaling_low_freq_factor: float = opt(1.0, "--rope-scaling-low-freq-factor",
                                              "Llama 3.x: low_freq_factor.")
    rope_scaling_high_freq_factor: float = opt(4.0, "--rope-scaling-high-freq-factor",
                                               "Llama 3.x: high_freq_factor.")
    rope_scaling_original_max_position_embeddings: int = opt(
        8192, "--rope-scaling-original-max-position-embeddings",
        "Llama 3.x: the context length before scaling.")
    rotary_percent: float = opt(1.0, "--rotary-percent",
                                "Partial rotary: the share of each head's channels rope turns "
                                "(the first int(head size x percent)); the rest pass through "
                                "(GPT-NeoX, Phi; Megatron's flag).")
    rotary_seq_len_interpolation_factor: float | None = opt(
        None, "--rotary-seq-len-interpolation-factor",
        "Linear rotary scaling: positions divided by this (Hugging Face rope_type 'linear').")
    # YaRN (Megatron's flags: MLA's --rotary-scaling-factor/--mscale/--mscale-all-dim, the GPT
    # model's --yarn-* for the rest), for MLA and the standard attention alike.
    rope_type: str | None = opt(
        None, "--rope-type",
        "Rotary variant: rope, or yarn (YaRN context extension: the --yarn-* options, "
        "--rotary-scaling-factor, --mscale, --mscale-all-dim). Default rope.",
        choices=("rope", "yarn"))
    rotary_scaling_factor: float = opt(1.0, "--rotary-scaling-factor",
                                       "YaRN: the context extension factor.",
                                       aliases=("--yarn-rotary-scaling-factor",))
    mscale: float = opt(1.0, "--mscale",
                        "YaRN: mscale (the attention factor's numerator, 0.1 mscale "
                        "ln(factor) + 1).", aliases=("--yarn-mscale",))
    mscale_all_dim: float = opt(0.0, "--mscale-all-dim",
                                "YaRN: mscale_all_dim (the attention factor's denominator; "
                                "with MLA also the softmax-scale correction).",
                                aliases=("--yarn-mscale-all-dim",))
    yarn_original_max_position_embeddings: int = opt(
        4096, "--yarn-original-max-position-embeddings",
        "YaRN: the context length the model was trained at before extension.")
    yarn_beta_fast: float = opt(32.0, "--yarn-beta-fast",
                                "YaRN: rotations above which a frequency is kept.")
    yarn_beta_slow: float = opt(1.0, "--yarn-beta-slow",
                                "YaRN: rotations below which a frequency is interpolated.")
    yarn_correction_range_round_to_int: bool = opt(
        True, "--yarn-correction-range-round-to-int",
        "YaRN: round the ramp's ends outwards to whole channels (Hugging Face's truncate).",
        is_flag=True, negative="--no-yarn-correction-range-round-to-int")
    # Multi-latent attention (DeepSeek-V2/V3), Megatron's flags and defaults.
    multi_latent_attention: bool = opt(
        False, "--multi-latent-attention",
        "Multi-latent attention (DeepSeek-V2/V3): keys and values from a compressed latent, "
        "a decoupled rotary part shared by every head (the sizes below).", is_flag=True)
    q_lora_rank: int | None = opt(None, "--q-lora-rank",
                                  "MLA: rank of the query compression (default: none, one "
                                  "query projection).")
    kv_lora_rank: int = opt(32, "--kv-lora-rank", "MLA: rank of the key/value latent.")
    qk_head_dim: int = opt(128, "--qk-head-dim",
                           "MLA: per-head query/key channels without position (rope-free).")
    qk_pos_emb_head_dim: int = opt(64, "--qk-pos-emb-head-dim",
                                   "MLA: per-head query/key channels that carry rotary "
                                   "position (the key part is shared by every head).")
    v_head_dim: int = opt(128, "--v-head-dim", "MLA: per-head value channels.")


#: Declared by the ``*`` layer type.
SECTION = ConfigSection("attention", AttentionOptions, title="Attention layer (*)")


def attention_options(config) -> AttentionOptions:
    """``config.attention``, or the defaults where the config has no such section."""
    options = getattr(config, "attention", None)
    return options if isinstance(options, AttentionOptions) else AttentionOptions()


def parse_window(value) -> tuple[int, int] | None:
    """``--window-size`` as ``(left, 0)``, or None for full causal attention; ConfigError for
    anything else."""
    if value is None or value == "":
        return None
    text = str(value).strip().strip("()[]")
    parts = [p.strip() for p in text.split(",")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2):
        raise ConfigError(f"--window-size {value!r}: expected LEFT or LEFT,0 with integers "
                          f"(e.g. 4095,0)")
    left, right = numbers[0], numbers[1] if len(numbers) == 2 else 0
    if left == -1:  # Megatron's/TE's "unbounded"
        return None
    if left < 0:
        raise ConfigError(f"--window-size {value!r}: LEFT must be at least 0 (or -1 for no "
                          f"window)")
    if right != 0:
        raise ConfigError(f"--window-size {value!r}: RIGHT must be 0; a decoder's attention "
                          f"is causal, it never sees later tokens")
    return left, 0


def rope_scaling(config) -> dict | None:
    """The rotary scaling of the run for :func:`rope.inv_frequencies`, or None."""
    o = attention_options(config)
    if o.rope_type == "yarn":
        return {"rope_type": "yarn", "factor": o.rotary_scaling_factor,
                "original_max_position_embeddings": o.yarn_original_max_position_embeddings,
                "beta_fast": o.yarn_beta_fast, "beta_slow": o.yarn_beta_slow,
                "truncate": o.yarn_correction_range_round_to_int,
                "mscale": o.mscale, "mscale_all_dim": o.mscale_all_dim}
    if o.use_rope_scaling:
        return {"rope_type": "llama3", "factor": o.rope_scaling_factor,
                "low_freq_factor": o.rope_scaling_low_freq_factor,
                "high_freq_factor": o.rope_scaling_high_freq_factor,
                "original_max_position_embeddings":
                    o.rope_scaling_original_max_position_embeddings}
    if o.rotary_seq_len_interpolation_factor is not None:
        return {"rope_type": "linear", "factor": o.rotary_seq_len_interpolation_factor}
    return None


def rotary_dim(config) -> int:
    """Channels the rotary embedding turns per head: MLA's ``--qk-pos-emb-head-dim`` (its
    decoupled rotary part), else the head size times ``--rotary-percent``."""
    o, m = attention_options(config), config.model
    if o.multi_latent_attention:
        return o.qk_pos_emb_head_dim
    head = m.kv_channels or m.hidden_size // m.num_attention_heads
    return int(head * o.rotary_percent)  # Megatron's rotary_dim


def validate_mla(config) -> None:
    """``--multi-latent-attention``: the sizes, and what it does not combine with."""
    o, m, p = attention_options(config), config.model, config.parallel
    for flag, value in (("--q-lora-rank", o.q_lora_rank), ("--kv-lora-rank", o.kv_lora_rank),
                        ("--qk-head-dim", o.qk_head_dim),
                        ("--qk-pos-emb-head-dim", o.qk_pos_emb_head_dim),
                        ("--v-head-dim", o.v_head_dim)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1 with --multi-latent-attention, got "
                              f"{value}")
    if o.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim {o.qk_pos_emb_head_dim} must be even: rotary "
                          f"embeddings turn pairs of channels")
    if m.position_embedding_type != "rope":
        raise ConfigError("--multi-latent-attention carries position in its decoupled rotary "
                          "part (--qk-pos-emb-head-dim): it needs --position-embedding-type "
                          "rope")
    groups = m.num_query_groups
    if groups is not None and groups != m.num_attention_heads:
        raise ConfigError(f"--num-query-groups {groups} with --multi-latent-attention: MLA "
                          f"expands keys and values for every head from one latent; leave "
                          f"--num-query-groups unset")
    for flag, value in (("--qk-layernorm", o.qk_layernorm), ("--add-qkv-bias", o.add_qkv_bias)):
        if value:
            raise ConfigError(f"{flag} is an option of the standard attention; "
                              f"--multi-latent-attention has its own q_layernorm/kv_layernorm on "
                              f"the latents and no q/k/v bias (Megatron-Core's MLA)")
    if selected_driver(config, "layer_backend") != "local":
        raise ConfigError(f"--multi-latent-attention is implemented with the 'local' layer "
                          f"backend (its core attention takes value heads of another size "
                          f"than the query/key heads), not {selected_driver(config, 'layer_backend')!r}")
    q_dim = o.qk_head_dim + o.qk_pos_emb_head_dim
    if p.context_parallel_size > 1 and p.cp_comm_type != "a2a" and o.v_head_dim > q_dim:
        raise ConfigError(f"--cp-comm-type {p.cp_comm_type} with --multi-latent-attention "
                          f"needs --v-head-dim ({o.v_head_dim}) at most --qk-head-dim + "
                          f"--qk-pos-emb-head-dim ({q_dim}): the ring and all-gather paths move "
                          f"keys and values as one tensor, values padded to the key size; use "
                          f"--cp-comm-type a2a")


#: The YaRN options and their defaults: set to anything else, they need --rope-type yarn.
_YARN_DEFAULTS = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                  "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
                  "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True}


def validate_yarn(config) -> None:
    """``--rope-type yarn`` and its options; options given without it are refused (they would
    change nothing)."""
    o = attention_options(config)
    if o.rope_type != "yarn":
        changed = [name for name, default in _YARN_DEFAULTS.items()
                   if getattr(o, name) != default]
        if changed:
            flags = ", ".join("--" + name.replace("_", "-") for name in changed)
            raise ConfigError(f"{flags} only apply to --rope-type yarn")
        return
    if config.model.position_embedding_type != "rope":
        raise ConfigError("--rope-type yarn scales rotary positions: it needs "
                          "--position-embedding-type rope")
    if o.use_rope_scaling or o.rotary_seq_len_interpolation_factor is not None:
        raise ConfigError("--rope-type yarn and --use-rope-scaling / "
                          "--rotary-seq-len-interpolation-factor are two rotary scalings; "
                          "choose one")
    if o.rotary_scaling_factor <= 0:
        raise ConfigError(f"--rotary-scaling-factor must be positive, got "
                          f"{o.rotary_scaling_factor}")
    if o.yarn_original_max_position_embeddings < 1:
        raise ConfigError("--yarn-original-max-position-embeddings must be at least 1")
    if not 0 < o.yarn_beta_slow < o.yarn_beta_fast:
        raise ConfigError(f"--yarn-beta-slow ({o.yarn_beta_slow}) must be positive and below "
                          f"--yarn-beta-fast ({o.yarn_beta_fast})")


def validate_attention(config) -> None:
    """The options' values, and what they do not combine with; before launch."""
    o = attention_options(config)
    if o.multi_latent_attention:
        validate_mla(config)
    validate_yarn(config)
    window = parse_window(o.window_size)
    # A window covering the whole sequence is plain causal attention (Mistral's 4096 at shorter
    # sequences): every path computes it.
    limits = window is not None and window[0] + 1 < config.model.seq_length
    if limits and config.parallel.context_parallel_size > 1:
        raise ConfigError(f"--window-size {o.window_size} shorter than --seq-length "
                          f"{config.model.seq_length} with --context-parallel-size > 1 is not "
                          f"supported: the cp attention paths are full causal; use cp 1")
    if limits and selected_driver(config, "layer_backend") != "local":
        raise ConfigError(f"--window-size is implemented by the 'local' layer backend, not "
                          f"{selected_driver(config, 'layer_backend')!r}")
    uses_rope_options = o.use_rope_scaling or o.rotary_seq_len_interpolation_factor is not None
    if uses_rope_options and config.model.position_embedding_type != "rope":
        raise ConfigError("--use-rope-scaling / --rotary-seq-len-interpolation-factor scale "
                          "rotary positions: they need --position-embedding-type rope")
    if o.use_rope_scaling and o.rotary_seq_len_interpolation_factor is not None:
        raise ConfigError("--use-rope-scaling and --rotary-seq-len-interpolation-factor are two "
                          "rotary scalings; choose one")
    if o.use_rope_scaling:
        if o.rope_scaling_factor <= 0:
            raise ConfigError(f"--rope-scaling-factor must be positive, got "
                              f"{o.rope_scaling_factor}")
        if not 0 < o.rope_scaling_low_freq_factor < o.rope_scaling_high_freq_factor:
            raise ConfigError(
                f"--rope-scaling-low-freq-factor ({o.rope_scaling_low_freq_factor}) must be "
                f"positive and below --rope-scaling-high-freq-factor "
                f"({o.rope_scaling_high_freq_factor})")
        if o.rope_scaling_original_max_position_embeddings < 1:
            raise ConfigError("--rope-scaling-original-max-position-embeddings must be at "
                              "least 1")
    if o.rotary_percent != 1.0:
        m = config.model
        head = m.kv_channels or m.hidden_size // m.num_attention_heads
        turned = int(head * o.rotary_percent)
        if not 0.0 < o.rotary_percent <= 1.0 or turned < 2 or turned % 2:
            raise ConfigError(f"--rotary-percent {o.rotary_percent}: rope turns "
                              f"int({head} x {o.rotary_percent}) = {turned} channels of each "
                              f"head; give a share in (0, 1] that makes an even number of at "
                              f"least 2")
        if o.multi_latent_attention:
            raise ConfigError("--rotary-percent with --multi-latent-attention: MLA's rotary "
                              "part is --qk-pos-emb-head-dim")
        if m.position_embedding_type != "rope":
            raise ConfigError("--rotary-percent needs --position-embedding-type rope")
    if (o.rotary_seq_len_interpolation_factor is not None
            and o.rotary_seq_len_interpolation_factor <= 0):
        raise ConfigError(f"--rotary-seq-len-interpolation-factor must be positive, got "
                          f"{o.rotary_seq_len_interpolation_factor}")


def attention_architecture(config) -> dict:
    """The options that change the function or the tensors, only where set (checkpoints written
    before they existed keep resuming)."""
    o = attention_options(config)
    out: dict[str, Any] = {}
    if o.add_qkv_bias and not config.model.add_bias_linear:
        out["--add-qkv-bias"] = True
    if o.qk_layernorm:
        out["--qk-layernorm"] = True
    if o.rotary_percent != 1.0:
        out["--rotary-percent"] = o.rotary_percent
    window = parse_window(o.window_size)
    if window is not None:
        out["--window-size"] = f"{window[0]},{window[1]}"
    scaling = rope_scaling(config) if config.model.position_embedding_type == "rope" else None
    if scaling is not None:
        out["--rope-scaling"] = scaling
    if o.multi_latent_attention:
        out["--multi-latent-attention"] = {
            "--q-lora-rank": o.q_lora_rank, "--kv-lora-rank": o.kv_lora_rank,
            "--qk-head-dim": o.qk_head_dim, "--qk-pos-emb-head-dim": o.qk_pos_emb_head_dim,
            "--v-head-dim": o.v_head_dim}
    return out
