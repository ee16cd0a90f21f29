"""The Hybrid model's own rules: the pattern, the Mamba sizes tp divides, the layer count, the
pipeline split (checked before launch), and the settings a checkpoint must agree on."""

from __future__ import annotations

import dataclasses

from plugtron.api import (
    ConfigError,
    PluginError,
    TrainConfig,
    check_context_parallel_layers,
    load_layer_types,
)
from plugtron_gpt.gpt.sizes import architecture as gpt_architecture
from plugtron_gpt.gpt.sizes import validate_sizes as validate_gpt_sizes
from plugtron_gpt.hybrid.options import mamba_sizes
from plugtron_gpt.hybrid.pattern import check_pattern, chunk_of, layer_symbols

#: --num-layers' own default: the core cannot tell it from a value given, so it means "unset"
#: and the pattern's count is used.
_DEFAULT_NUM_LAYERS = TrainConfig().model.num_layers


def with_pattern_layers(config):
    """``config`` with ``--num-layers`` the pattern's layer count (a copy when it differs), so
    the layer types' scaled inits and every later reader see the real depth."""
    count = len(layer_symbols(config.hybrid.layer_pattern))
    if config.model.num_layers == count:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=count))


def validate_hybrid(config) -> None:
    o, m, p = config.hybrid, config.model, config.parallel
    pattern = o.layer_pattern
    if "/" in pattern:
        raise ConfigError(f"--hybrid-layer-pattern {pattern!r}: multi-token prediction ('/') "
                          f"is not supported")
    check_pattern(pattern)
    symbols = layer_symbols(pattern)
    try:
        layer_types = load_layer_types(symbols)
    except PluginError as exc:
        raise ConfigError(f"--hybrid-layer-pattern {pattern!r}: {exc}") from None
    if m.num_layers not in (len(symbols), _DEFAULT_NUM_LAYERS):
        raise ConfigError(f"--num-layers {m.num_layers} differs from the {len(symbols)} layers "
                          f"of --hybrid-layer-pattern {pattern!r}")
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size or 1
    if "M" in symbols:
        _validate_mamba(config, tp)
        if cp > 1:
            raise ConfigError(f"--cp {cp}: context parallelism is not supported with Mamba "
                              f"layers (M in --hybrid-layer-pattern)")
    # The pattern is what the Hybrid model builds (no substitution): every other layer type in
    # it (MoE E, a third party's) must declare cp support too.
    check_context_parallel_layers(config, layer_types.values())
    if "*" in symbols or "-" in symbols:
        validate_gpt_sizes(config)
    elif m.hidden_size % tp:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --tp {tp}")
    pp, vp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    for rank in range(pp):
        for stage in range(vp or 1):
            chunk_of(pattern, pp, rank, vp, stage if vp else None,
                     p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers,
                     p.pipeline_placement)


def _validate_mamba(config, tp: int) -> None:
    o = config.hybrid
    for flag, value in (("--mamba-state-dim", o.state_dim), ("--mamba-head-dim", o.head_dim),
                        ("--mamba-num-groups", o.num_groups), ("--mamba-num-heads", o.num_heads),
                        ("--mamba-chunk-size", o.chunk_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    size = mamba_sizes(config)
    heads, groups = size["heads"], size["groups"]
    if heads < 1:
        raise ConfigError(f"2 x --hidden-size {config.model.hidden_size} / --mamba-head-dim "
                          f"{o.head_dim} gives no Mamba heads; give --mamba-num-heads")
    if heads % groups:
        raise ConfigError(f"Mamba heads {heads} are not divisible by --mamba-num-groups "
                          f"{groups}: each group's B and C serve whole heads")
    if heads % tp:
        raise ConfigError(f"Mamba heads {heads} are not divisible by --tp {tp}: each "
                          f"tensor-parallel rank needs whole heads")
    if groups % tp:
        raise ConfigError(f"--mamba-num-groups {groups} is not divisible by --tp {tp}: each "
                          f"tensor-parallel rank needs whole groups")


def hybrid_architecture(config) -> dict:
    """The GPT settings that still shape the model, the pattern and the Mamba sizes."""
    o = config.hybrid
    symbols = layer_symbols(o.layer_pattern)
    out = gpt_architecture(with_pattern_layers(config))
    out["--max-position-embeddings"] = None  # no learned position table
    if config.model.position_embedding_type != "rope":
        out["--position-embedding-type"] = None
    # The segment boundaries move layers between stages, not what they compute.
    out["--hybrid-layer-pattern"] = symbols
    if "M" in symbols:
        size = mamba_sizes(config)
        out.update({"--mamba-state-dim": size["state"], "--mamba-head-dim": size["head_dim"],
                    "--mamba-num-groups": size["groups"], "--mamba-num-heads": size["heads"],
                    "--mamba-dt-limit-min": o.dt_limit_min})
    return out

