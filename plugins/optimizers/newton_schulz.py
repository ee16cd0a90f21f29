"""The Newton-Schulz iteration that orthogonalizes a matrix (Muon's step), its coefficient
schedules and the scale its result is given.

The iteration maps every singular value of ``X / |X|_F`` towards 1 with an odd quintic
polynomial ``a x + b x^3 + c x^5``, applied as ``X <- a X + (b G + c G^2) X`` with the Gram
matrix ``G = X X^T`` of the shorter side. Five steps of well chosen coefficients leave the
singular values near 1 (not exactly: close enough for an optimizer, and cheap on matrix units).

``--muon-fp32-matmul-prec`` is Megatron-Core's: torch's float32 matmul precision, set around
the iteration. At ``medium`` (its default, and here) the iteration runs in bfloat16, whatever the
parameters' dtype: Megatron-Core's Newton-Schulz (emerging_optimizers) casts the matrix to bf16
whenever the precision is ``medium``, as torch.optim.Muon always does. So an fp32 run is not
exact under the default, in Megatron-Core either: a bf16 iteration turns the float noise of a
differently summed gradient (another tp, dp or pp layout) into whole bf16 steps. ``high`` keeps
fp32 tensors and lets matmuls use TF32 where the hardware has it (CUDA); ``highest`` is fp32
throughout, what makes a parallel run equal a single process to fp32 rounding (``high`` does
too on the CPUs the suite runs on, which compute both alike).
"""

from __future__ import annotations

import contextlib
import math

import torch
from plugtron.api import all_reduce

#: Coefficient schedules by Megatron-Core's ``--muon-coefficient-type`` names. ``simple``
#: repeats Keller Jordan's (a, b, c), torch.optim.Muon's default; ``quintic`` cycles five
#: per-step tunings; ``polar_express`` (Amsel et al. 2025) has eight, its last one repeated.
COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
}

#: ``--muon-fp32-matmul-prec`` (torch's float32 matmul precisions) -> the dtype the iteration
#: runs in.
PRECISIONS = {"medium": torch.bfloat16, "high": torch.float32, "highest": torch.float32}

#: How the orthogonalized update is scaled for a matrix of ``rows x cols`` (Megatron-Core's
#: ``--muon-scale-mode``): ``spectral`` sqrt(max(rows, cols)) (times 0.2 it matches AdamW's
#: update RMS: torch's ``match_rms_adamw``), ``shape_scaling`` sqrt(max(1, rows / cols))
#: (Keller Jordan's, torch's ``original``), ``unit_rms_norm`` sqrt(rows / cols).
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")

#: Smallest norm divided by: a zero momentum stays zero instead of becoming NaN.
EPS = 1e-7


def schedule(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``steps`` (a, b, c) of coefficient set ``kind``; ``ValueError`` naming the rule
    when ``steps`` does not fit it (``quintic``: a multiple of 5, ``polar_express``: >= 8)."""
    if kind not in COEFFICIENTS:
        raise ValueError(f"unknown coefficient type {kind!r} (one of {', '.join(COEFFICIENTS)})")
    if steps < 1:
        raise ValueError(f"needs at least one step, got {steps}")
    sets = list(COEFFICIENTS[kind])
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        if steps < len(sets):
            raise ValueError(f"polar_express needs at least {len(sets)} steps, got {steps}")
        return sets + [sets[-1]] * (steps - len(sets))
    if steps % len(sets):
        raise ValueError(f"{kind} needs a multiple of {len(sets)} steps, got {steps}")
    return sets * (steps // len(sets))


def newton_schulz(matrix: torch.Tensor, coefficients: list[tuple[float, float, float]],
                  dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalized ``matrix`` (2-D), in ``dtype``; ``matrix`` itself is not changed.

    The same operations in the same order as torch.optim.Muon's, so a bf16 run matches it."""
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # the Gram matrix of the shorter side is the smaller one
        x = x.T
    x = x / x.norm().clamp(min=EPS)  # spectral norm <= Frobenius norm = 1
    for a, b, c in coefficients:
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def newton_schulz_sharded(shard: torch.Tensor, coefficients: list[tuple[float, float, float]],
                          dtype: torch.dtype, sharded_dim: int, group) -> torch.Tensor:
    """This rank's part of the orthogonalized matrix whose ``sharded_dim`` is split over
    ``group`` (``--muon-tp-mode distributed``, Megatron-Core's): the iteration runs on the
    shards, with the Gram matrix of the unsplit side (``X X^T`` once the split side is the
    columns) and the squared Frobenius norm summed over the group, so every rank steps its
    columns of the whole matrix's iteration. The odd polynomial of ``X`` is the same from
    either side: the single process's update, to float rounding; the Gram matrix may be the
    larger one (of the unsplit side), the price of no gather."""
    x = shard.to(dtype)
    if sharded_dim == 0:  # the split side goes to the columns
        x = x.T
    square = all_reduce(x.float().square().sum(), group)
    x = x / square.sqrt().clamp(min=EPS).to(dtype)
    for a, b, c in coefficients:
        # summed in fp32 (gloo has no bf16 sum), then the iteration's dtype again
        gram = all_reduce((x @ x.T).float(), group).to(dtype)
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if sharded_dim == 0 else x


@contextlib.contextmanager
def matmul_precision(precision: str):
    """torch's float32 matmul precision ``precision`` for the ``with`` block (Megatron-Core
    sets ``--muon-fp32-matmul-prec`` so around its iteration), the previous one after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The factor the orthogonalized update of a ``rows x cols`` matrix is multiplied by."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"unknown scale mode {mode!r} (one of {', '.join(SCALE_MODES)})")
