"""The GPT model's own rules: which sizes must divide (checked before launch) and which settings
a checkpoint must agree on to be resumed."""

from __future__ import annotations

from typing import Any

from plugtron.api import ConfigError
from plugtron_gpt.gpt.mtp import mtp_depth
from plugtron_gpt.layers.attention_options import attention_architecture
from plugtron_gpt.layers.mlp import openai_gelu, squared_relu


def validate_sizes(config) -> None:
    """Heads, query groups and the hidden/ffn sizes that attention, the MLP and tensor
    parallelism split; every tp rank must hold whole heads and whole groups."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    for name, value in (("--num-attention-heads", m.num_attention_heads),
                        ("--num-query-groups", m.num_query_groups),
                        ("--ffn-hidden-size", m.ffn_hidden_size),
                        ("--kv-channels", m.kv_channels)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    if heads % groups:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by "
                          f"--num-query-groups {groups}")
    if m.kv_channels is None and m.hidden_size % heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by "
                          f"--num-attention-heads {heads} (or give --kv-channels)")
    if heads % tp:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --tp {tp}: each "
                          f"tensor-parallel rank needs whole attention heads")
    if groups % tp:
        raise ConfigError(f"--num-query-groups {groups} is not divisible by --tp {tp}: each "
                          f"tensor-parallel rank needs whole key/value groups (use a multiple "
                          f"of {tp} query groups, or a smaller --tp)")
    if m.hidden_size % tp:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --tp {tp}")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp:
        raise ConfigError(f"--ffn-hidden-size {ffn} is not divisible by --tp {tp}")


def architecture(config) -> dict:
    """``{flag: effective value}`` of every setting that changes tensor shapes or the function
    the weights compute, with derived defaults filled in so that equal models compare equal."""
    m = config.model
    heads = m.num_attention_heads
    learned = m.position_embedding_type == "learned_absolute"
    # Only when set: checkpoints written before the option existed keep resuming.
    activation: dict[str, Any] = {"--squared-relu": True} if squared_relu(config) else {}
    if openai_gelu(config):
        activation["--openai-gelu"] = True
    if mtp_depth(config):
        activation["--mtp-num-layers"] = mtp_depth(config)
    return activation | attention_architecture(config) | {
        "--num-layers": m.num_layers, "--hidden-size": m.hidden_size,
        "--ffn-hidden-size": m.ffn_hidden_size or 4 * m.hidden_size,
        "--num-attention-heads": heads, "--num-query-groups": m.num_query_groups or heads,
        "--kv-channels": m.kv_channels or m.hidden_size // heads,
        "--vocab-size": m.vocab_size, "--position-embedding-type": m.position_embedding_type,
        # No tensor depends on the table size under rope, nor on the base without it.
        "--max-position-embeddings": (m.max_position_embeddings or m.seq_length) if learned
        else None,
        "--rotary-base": m.rotary_base if m.position_embedding_type == "rope" else None,
        "--normalization": m.normalization, "--norm-epsilon": m.norm_epsilon,
        "--swiglu": m.swiglu,
        "--untie-embeddings-and-output-weights": m.untie_embeddings_and_output_weights,
        "--add-bias-linear": m.add_bias_linear,
    }
