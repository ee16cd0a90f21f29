"""The hybrid layer pattern: which layer type each decoder layer is, and which layers each
pipeline chunk holds.

``"M*-M-"`` is five layers, ``decoder.layers.0`` a Mamba layer, ``.1`` attention, and so on.
``|`` cuts the pattern into pipeline segments, Megatron's way: segment ``vp_stage x pp +
pp_rank`` is the chunk ``vp_stage`` of rank ``pp_rank``, so a pattern with ``|`` has exactly
``pp x vp`` segments. Without ``|`` the layers split evenly as the GPT model's do.
"""

from __future__ import annotations

from plugtron.api import LOOPED, ConfigError, chunk_layers, virtual_stage

SEGMENT = "|"


def layer_symbols(pattern: str) -> str:
    """The pattern without its segment boundaries: one symbol per layer."""
    return pattern.replace(SEGMENT, "")


def check_pattern(pattern: str, known: set[str] | None = None) -> None:
    """Refuse an empty pattern, empty segments, and symbols with no layer type (``known``)."""
    symbols = layer_symbols(pattern)
    if not symbols:
        raise ConfigError(f"--hybrid-layer-pattern {pattern!r} has no layers")
    if SEGMENT in pattern and any(not seg for seg in pattern.split(SEGMENT)):
        raise ConfigError(f"--hybrid-layer-pattern {pattern!r} has an empty pipeline segment")
    if known is not None:
        unknown = sorted(set(symbols) - known)
        if unknown:
            raise ConfigError(f"--hybrid-layer-pattern {pattern!r}: no layer type is installed "
                              f"for {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(map(repr, sorted(known)))}")


def segment_ranges(pattern: str) -> list[range]:
    """Global layer indices of each ``|`` segment, in order."""
    out, start = [], 0
    for segment in pattern.split(SEGMENT):
        out.append(range(start, start + len(segment)))
        start += len(segment)
    return out


def chunk_of(pattern: str, pp: int, pp_rank: int, vp: int | None, vp_stage: int | None,
             first: int | None = None, last: int | None = None,
             placement: str = LOOPED) -> range:
    """Global indices of the layers held by chunk ``vp_stage`` of ``pp_rank``; segment ``s``
    of a ``|`` pattern is virtual stage ``s``, wherever ``placement`` puts it."""
    if SEGMENT not in pattern:
        return chunk_layers(len(pattern), pp, pp_rank, vp, vp_stage, first, last, placement)
    segments = segment_ranges(pattern)
    chunks = pp * (vp or 1)
    if len(segments) != chunks:
        raise ConfigError(f"--hybrid-layer-pattern {pattern!r} has {len(segments)} pipeline "
                          f"segments; --pp {pp} x --vp {vp or 1} needs {chunks}")
    if first is not None or last is not None:
        raise ConfigError("--decoder-first/last-pipeline-num-layers cannot be combined with "
                          "'|' in --hybrid-layer-pattern: the pattern places the layers")
    return segments[virtual_stage(pp_rank, vp_stage or 0, pp, placement)]
