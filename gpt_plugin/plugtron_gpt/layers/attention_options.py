"""Options of the attention layer type ``*`` (Megatron's flag names), its config section
``attention``: bias on q/k/v only, per-head q/k norms, sliding windows and rotary scaling.

Declared by the layer type itself (as the MLP's ``--squared-relu``), so every model composing
``*`` has them; code reads them through :func:`attention_options`, which gives the defaults
where a config was built without the section (an old checkpoint, a model without ``*``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import ConfigError, ConfigSection, opt


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
    rotary_seq_len_interpolation_factor: float | None = opt(
        None, "--rotary-seq-len-interpolation-factor",
        "Linear rotary scaling: positions divided by this (Hugging Face rope_type 'linear').")


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
    if o.use_rope_scaling:
        return {"rope_type": "llama3", "factor": o.rope_scaling_factor,
                "low_freq_factor": o.rope_scaling_low_freq_factor,
                "high_freq_factor": o.rope_scaling_high_freq_factor,
                "original_max_position_embeddings":
                    o.rope_scaling_original_max_position_embeddings}
    if o.rotary_seq_len_interpolation_factor is not None:
        return {"rope_type": "linear", "factor": o.rotary_seq_len_interpolation_factor}
    return None


def validate_attention(config) -> None:
    """The options' values, and what they do not combine with; before launch."""
    o = attention_options(config)
    window = parse_window(o.window_size)
    # A window covering the whole sequence is plain causal attention (Mistral's 4096 at shorter
    # sequences): every path computes it.
    limits = window is not None and window[0] + 1 < config.model.seq_length
    if limits and config.parallel.context_parallel_size > 1:
        raise ConfigError(f"--window-size {o.window_size} shorter than --seq-length "
                          f"{config.model.seq_length} with --context-parallel-size > 1 is not "
                          f"supported: the cp attention paths are full causal; use cp 1")
    if limits and config.plugins.layer_backend != "local":
        raise ConfigError(f"--window-size is implemented by the 'local' layer backend, not "
                          f"{config.plugins.layer_backend!r}")
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
    if (o.rotary_seq_len_interpolation_factor is not None
            and o.rotary_seq_len_interpolation_factor <= 0):
        raise ConfigError(f"--rotary-seq-len-interpolation-factor must be positive, got "
                          f"{o.rotary_seq_len_interpolation_factor}")


def attention_architecture(config) -> dict:
    """The options that change the function or the tensors, only where set (checkpoints written
    before they existed keep resuming)."""
    o = attention_options(config)
    out = {}
    if o.add_qkv_bias and not config.model.add_bias_linear:
        out["--add-qkv-bias"] = True
    if o.qk_layernorm:
        out["--qk-layernorm"] = True
    window = parse_window(o.window_size)
    if window is not None:
        out["--window-size"] = f"{window[0]},{window[1]}"
    scaling = rope_scaling(config) if config.model.position_embedding_type == "rope" else None
    if scaling is not None:
        out["--rope-scaling"] = scaling
    return out
