"""The transformer's architecture options (Megatron's flag names): heads, query groups, head
size, MLP width and activation, biases, position encoding, attention dropout.

Section ``transformer`` extends the core's ``model`` section (``ConfigSection.extends``): the
fields read and write as ``config.model.<field>``, config files set them by bare name or under
``[model]``, and checkpoints keep them inside ``model``, exactly where a Megatron user (and
every checkpoint saved before the fields left the core) has them. Declared by the attention layer
type ``*``, so every model of this distribution and every layer type composed with it (the MLP,
plugtron-moe's experts) finds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import ConfigError, ConfigSection, opt


@dataclass
class TransformerOptions:
    ffn_hidden_size: int | None = opt(None, "--ffn-hidden-size",
                                      "MLP hidden size (default 4 x hidden).")
    num_attention_heads: int = opt(4, "--num-attention-heads", "Number of attention heads.")
    num_query_groups: int | None = opt(None, "--num-query-groups",
                                       "Key/value groups for grouped-query attention "
                                       "(default: one per head).")
    kv_channels: int | None = opt(None, "--kv-channels", "Per-head size (default hidden/heads).")
    max_position_embeddings: int | None = opt(None, "--max-position-embeddings",
                                              "Size of the learned position table "
                                              "(default seq-length).")
    position_embedding_type: str = opt("learned_absolute", "--position-embedding-type",
                                       "Position encoding.",
                                       choices=("learned_absolute", "rope"))
    rotary_base: int = opt(10000, "--rotary-base", "Base of the rotary frequencies.")
    swiglu: bool = opt(False, "--swiglu", "SwiGLU MLP instead of GeLU.", is_flag=True)
    add_bias_linear: bool = opt(True, "--add-bias-linear", "Biases in linear layers.",
                                is_flag=True, negative="--disable-bias-linear")
    attention_dropout: float = opt(0.1, "--attention-dropout", "Dropout of attention weights.")


SECTION = ConfigSection("transformer", TransformerOptions, title="Transformer", extends="model")


def validate_transformer(config) -> None:
    """Before launch: the options' ranges, and the head split ``--cp-comm-type a2a`` needs."""
    m, p = config.model, config.parallel
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"--max-position-embeddings {m.max_position_embeddings} is smaller "
                          f"than --seq-length {m.seq_length}")
    if not 0.0 <= m.attention_dropout < 1.0:
        raise ConfigError(f"--attention-dropout must be in [0, 1), got {m.attention_dropout}")
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp > 1 and p.cp_comm_type == "a2a":
        heads = m.num_attention_heads // tp
        groups = (m.num_query_groups or m.num_attention_heads) // tp
        if heads % cp or groups % cp:
            raise ConfigError(f"--cp-comm-type a2a trades the sequence split for a head split: "
                              f"the {heads} heads and {groups} query groups per tp rank must "
                              f"both be divisible by --cp {cp}; use p2p or allgather")
