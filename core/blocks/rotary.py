"""Rotary position embeddings for any model plugin (``plugtron.api``): rotate-half form, as
Megatron-Core and Llama use; partial rotary (Megatron's ``--rotary-percent``, GPT-J's and
GPT-NeoX's ``rotary_dim``: angles for the first channels of a head, the rest pass through);
DeepSeek's interleaved pairs; and the frequency scalings Hugging Face checkpoints carry: Llama
3.x (``llama3``), linear, and YaRN (``yarn``: frequencies blended between kept and interpolated
by a ramp over the channels, and an attention factor on cos and sin,
:func:`yarn_attention_factor`).

A model computes the angles once per forward (:func:`rotary_freqs_at` at the batch's positions,
which under context parallelism are two distant chunks) and each attention layer turns its
queries and keys with :func:`apply_rotary`."""

from __future__ import annotations

import math

import torch


def inv_frequencies(dim: int, base: float, scaling: dict | None = None,
                    device=None) -> torch.Tensor:
    """``[dim / 2]`` inverse frequencies, scaled by ``scaling`` (see
    ``attention_options.rope_scaling``). Computed in fp32 by the same operations in the same
    order as transformers' rope initialisers, so imported models give the same angles."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if scaling is None:
        return inv
    if scaling["rope_type"] == "linear":
        return inv / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn(inv, dim, base, scaling)
    return _llama3(inv, scaling)


def _yarn_channel(rotations: float, dim: int, base: float, original: int) -> float:
    """The (fractional) channel pair whose frequency turns ``rotations`` times over the
    original context: YaRN's inverse of ``original / wavelength``."""
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn(inv: torch.Tensor, dim: int, base: float, s: dict) -> torch.Tensor:
    """YaRN: pairs below the ``beta_fast`` channel keep their frequency (they turn often within
    the original context), pairs past the ``beta_slow`` channel are divided by ``factor``, a
    linear ramp blends those between."""
    original = s["original_max_position_embeddings"]
    low = _yarn_channel(s["beta_fast"], dim, base, original)
    high = _yarn_channel(s["beta_slow"], dim, base, original)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv.device) - low)
            / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    # transformers' order of operations, so imported models get the same angles to the bit
    base_powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=inv.device) / dim)
    return 1.0 / (s["factor"] * base_powers) * (1 - kept) + inv * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for factors up to 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by under YaRN, Megatron-Core's concentration factor:
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; 1 for other scalings."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    return (yarn_mscale(scaling["factor"], scaling["mscale"])
            / yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]))


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.x: wavelengths longer than ``original / low`` are stretched by ``factor``, those
    shorter than ``original / high`` kept, the band between blended linearly in 1/wavelength."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    stretched = torch.where(wavelength > original / low, inv / factor, inv)
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * stretched / factor + blend * stretched
    middle = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(middle, blended, stretched)


def rotary_freqs(seq_length: int, dim: int, base: float, device=None,
                 scaling: dict | None = None) -> torch.Tensor:
    """Angles ``[seq, dim]`` for positions 0..seq-1 (each frequency used twice)."""
    inv = inv_frequencies(dim, base, scaling, device)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv)
    return torch.cat([angles, angles], dim=-1)


def rotary_freqs_at(position_ids: torch.Tensor, dim: int, base: float,
                    scaling: dict | None = None) -> torch.Tensor:
    """Angles ``[b, s, dim]`` at the given positions ``[b, s]``: under context parallelism a
    rank holds two distant chunks of the sequence, not positions 0..s-1."""
    inv = inv_frequencies(dim, base, scaling, position_ids.device)
    angles = position_ids.to(torch.float32)[..., None] * inv
    return torch.cat([angles, angles], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0,
                 interleaved_pairs: bool = False) -> torch.Tensor:
    """``x``: ``[b, s, heads, d]``; ``freqs``: ``[s, r]`` or per sample ``[b, s, r]``, from
    :func:`rotary_freqs` or :func:`rotary_freqs_at` with ``dim=r``. ``r < d`` is partial
    rotary: the first ``r`` channels of each head are turned, the other ``d - r`` pass through
    unchanged (Megatron's ``--rotary-percent``: ``r = int(d * percent)``).

    ``mscale``: cos and sin multiplied by it (YaRN's attention factor). ``interleaved_pairs``:
    the channels come as pairs ``(x0, x1), (x2, x3), ...`` each turned by one frequency
    (DeepSeek's layout, Megatron-Core's ``mla_rotary_interleaved``): they are first regrouped as
    ``[x0, x2, ..; x1, x3, ..]`` and the result stays in that order (queries and keys alike, so
    their products are those of the pairs)."""
    turned = freqs.shape[-1]
    if turned > x.shape[-1] or turned % 2:
        raise ValueError(f"rotary angles for {turned} channels cannot turn a head of "
                         f"{x.shape[-1]} (at most the head, an even number)")
    if turned < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :turned], freqs, mscale, interleaved_pairs),
                          x[..., turned:]], dim=-1)
    if interleaved_pairs:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    freqs = freqs if freqs.dim() == 3 else freqs[None]
    cos, sin = freqs.cos(), freqs.sin()
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos = cos[:, :, None, :].to(x.dtype)
    sin = sin[:, :, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin
