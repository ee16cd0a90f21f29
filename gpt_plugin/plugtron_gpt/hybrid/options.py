"""The Hybrid model's own options (Megatron's flag names), declared as its config section
``hybrid``: ``config.hybrid.layer_pattern``, ``config.hybrid.state_dim``, ..."""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import ConfigSection, opt

#: Kernel width of the Mamba mixer's causal depthwise convolution (Megatron's ``d_conv``).
CONV_WIDTH = 4


@dataclass
class HybridOptions:
    layer_pattern: str = opt(
        "M*-M-", "--hybrid-layer-pattern",
        "One symbol per decoder layer: M Mamba-2, * attention, - MLP, E MoE (plugtron-moe); "
        "| ends a pipeline segment (segment = vp_stage x pp + pp_rank).",
        aliases=("--hybrid-override-pattern",))
    state_dim: int = opt(128, "--mamba-state-dim", "SSM state size N per group.")
    head_dim: int = opt(64, "--mamba-head-dim", "Channels P per Mamba head.")
    num_groups: int | None = opt(None, "--mamba-num-groups",
                                 "B/C groups G, heads sharing a group's B and C (default 8, or "
                                 "the number of heads when there are fewer).")
    num_heads: int | None = opt(None, "--mamba-num-heads",
                                "Mamba heads (default 2 x hidden / head dim).")
    chunk_size: int = opt(128, "--mamba-chunk-size", "Tokens per chunk of the SSD scan.")
    dt_limit_min: float = opt(0.0, "--mamba-dt-limit-min",
                              "Clamp softplus(dt) from below (HF's time_step_limit[0]); "
                              "0 leaves dt unclamped.")


SECTION = ConfigSection("hybrid", HybridOptions, title="Hybrid model")


def mamba_sizes(config) -> dict:
    """Heads, groups, state, head dim and the inner width (heads x head dim) of a Mamba layer."""
    o = config.hybrid
    heads = o.num_heads or 2 * config.model.hidden_size // o.head_dim
    # Megatron's default of 8 groups needs 8 heads; a small model (hidden 128: 4 heads) gets one
    # group per head instead of a refusal.
    groups = o.num_groups or min(8, max(heads, 1))
    return {"heads": heads, "groups": groups, "state": o.state_dim,
            "head_dim": o.head_dim, "inner": heads * o.head_dim}
