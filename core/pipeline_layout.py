"""Which decoder layers each pipeline chunk holds (Megatron's layer offsets)."""

from __future__ import annotations

from .errors import ConfigError


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers per pipeline stage: even, or with the first/last stage sizes given and the rest
    split evenly over the middle stages."""
    if first is None and last is None:
        if num_layers % pp:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by --pp {pp}; give "
                              f"--decoder-first/last-pipeline-num-layers for an uneven split")
        return [num_layers // pp] * pp
    if pp < 2:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need --pp > 1")
    counts = [None] * pp
    rest, middle = num_layers, pp
    if first is not None:
        counts[0], rest, middle = first, rest - first, middle - 1
    if last is not None:
        counts[-1], rest, middle = last, rest - last, middle - 1
    if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
        raise ConfigError(f"{num_layers} layers cannot be split over {pp} stages with "
                          f"first={first}, last={last}: the remaining {rest} layers must divide "
                          f"evenly over the other {middle} stages")
    return [c if c is not None else rest // middle for c in counts]


def chunk_layers(num_layers: int, pp: int, pp_rank: int, vp: int | None, vp_stage: int | None,
                 first: int | None = None, last: int | None = None) -> range:
    """0-based global indices of the layers held by chunk ``vp_stage`` on ``pp_rank``.

    Without interleaving a stage holds one contiguous block. With ``vp`` chunks per rank the
    model is cut into ``pp * vp`` pieces and piece ``v * pp + p`` lives on rank ``p`` as chunk
    ``v`` (offset ``v*L/vp + p*L/(pp*vp)`` for even splits).
    """
    chunks = vp or 1
    v = vp_stage or 0
    if chunks == 1:
        counts = stage_layer_counts(num_layers, pp, first, last)
        start = sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])
    if first is not None or last is not None:
        raise ConfigError("uneven first/last pipeline stages are not supported with --vp")
    if num_layers % (pp * chunks):
        raise ConfigError(f"--num-layers {num_layers} is not divisible by --pp {pp} x --vp "
                          f"{chunks} = {pp * chunks}")
    per_chunk = num_layers // (pp * chunks)
    start = (v * pp + pp_rank) * per_chunk
    return range(start, start + per_chunk)
