"""Rotary position embeddings (rotate-half form, as Megatron-Core and Llama use)."""

from __future__ import annotations

import torch


def rotary_freqs(seq_length: int, dim: int, base: float, device=None) -> torch.Tensor:
    """Angles ``[seq, dim]`` for positions 0..seq-1 (each frequency used twice)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv)
    return torch.cat([angles, angles], dim=-1)


def rotary_freqs_at(position_ids: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """Angles ``[b, s, dim]`` at the given positions ``[b, s]``: under context parallelism a
    rank holds two distant chunks of the sequence, not positions 0..s-1."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                       device=position_ids.device) / dim))
    angles = position_ids.to(torch.float32)[..., None] * inv
    return torch.cat([angles, angles], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x``: ``[b, s, heads, d]``; ``freqs``: ``[s, d]`` or per sample ``[b, s, d]``."""
    freqs = freqs if freqs.dim() == 3 else freqs[None]
    cos = freqs.cos()[:, :, None, :].to(x.dtype)
    sin = freqs.sin()[:, :, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin
