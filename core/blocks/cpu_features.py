"""Which matrix instructions this CPU has for a half-precision dtype.

CPU half precision is three different machines: without native instructions (AVX2 only) oneDNN
emulates bf16/fp16 and runs fast in one operand layout only; with AVX-512 BF16/FP16 every
layout runs at full speed; with AMX tiles a bf16 matmul is several times faster than fp32 and so
is torch's flash-attention forward. Code that works around the first (core/blocks/linear.py, the local
backend's attention) must not tax the other two: measured on a Xeon with AMX-BF16 and
AVX512-FP16 (benchmarks/RESULTS.md, "Half precision on a CPU with AMX"), the layout copies made
a bf16 step 1.5x slower than plain autograd.
"""

from __future__ import annotations

import functools

import torch

#: The features that give each dtype its native paths, by level.
_NATIVE = {
    torch.bfloat16: {"amx": ("amx_bf16",), "avx512": ("avx512_bf16",)},
    torch.float16: {"amx": ("amx_fp16",), "avx512": ("avx512_fp16",)},
}


@functools.lru_cache(maxsize=None)
def _features() -> frozenset:
    try:  # torch's own CPU probe (cpuinfo); private, so an older torch may lack it
        capability = torch._C._cpu._get_cpu_capability()
    except (AttributeError, RuntimeError):
        return frozenset()
    return frozenset(name for name, present in capability.items() if present is True)


def cpu_matrix_support(dtype: torch.dtype) -> str:
    """``"amx"``, ``"avx512"`` or ``"emulated"``: how this CPU multiplies ``dtype`` matrices
    (fp32 and fp64 are always ``"native"``). Unknown CPUs count as emulated, the safe side."""
    return _levels(_features()).get(dtype, "native")


@functools.lru_cache(maxsize=None)
def _levels(features: frozenset) -> dict:
    """Each half dtype's level for one feature set (every linear call asks: a dict lookup)."""
    out = {}
    for dtype, levels in _NATIVE.items():
        out[dtype] = next((level for level in ("amx", "avx512")
                           if any(name in features for name in levels[level])), "emulated")
    return out
