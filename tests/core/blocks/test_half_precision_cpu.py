"""CPU half precision: the linear whose backward matmuls take the fast operand layout
(core/blocks/linear.py) and the local backend's attention computed in fp32. Both must give what the
plain ops give (to the precision's rounding), and the layouts must be the fast ones. Both apply
only where the CPU emulates the dtype (core/blocks/cpu_features.py): the tests pin the CPU's features,
so they check the same paths on an AVX2 machine and on one with AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plugtron.api import linear
from torch.utils._python_dispatch import TorchDispatchMode

HALF = [torch.bfloat16, torch.float16]

#: CPU feature sets as torch's probe names them: no native half precision, AVX-512 BF16/FP16
#: without AMX, and AMX for both dtypes.
CPUS = {"avx2": frozenset({"avx2"}),
        "avx512": frozenset({"avx2", "avx512_bf16", "avx512_fp16"}),
        "amx": frozenset({"avx2", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})}


def _pin_cpu(monkeypatch, name):
    from plugtron.core.blocks import cpu_features

    monkeypatch.setattr(cpu_features, "_features", lambda: CPUS[name])


@pytest.fixture
def emulated(monkeypatch):
    """A CPU without native bf16/fp16 matrix instructions (AVX2 only)."""
    _pin_cpu(monkeypatch, "avx2")


@pytest.mark.parametrize("cpu, expected", [
    ("avx2", {torch.bfloat16: "emulated", torch.float16: "emulated"}),
    ("avx512", {torch.bfloat16: "avx512", torch.float16: "avx512"}),
    ("amx", {torch.bfloat16: "amx", torch.float16: "amx"}),
])
def test_cpu_matrix_support_levels(monkeypatch, cpu, expected):
    from plugtron.api import cpu_matrix_support

    _pin_cpu(monkeypatch, cpu)
    assert {dtype: cpu_matrix_support(dtype) for dtype in HALF} == expected
    assert cpu_matrix_support(torch.float32) == "native"


def test_cpu_matrix_support_reads_this_cpu():
    """The real probe answers for this machine (whatever it is) with one of the levels."""
    from plugtron.api import cpu_matrix_support

    assert {cpu_matrix_support(dtype) for dtype in HALF} <= {"amx", "avx512", "emulated"}


class _MatmulLayouts(TorchDispatchMode):
    """Records, for every aten.mm/addmm, whether the left operand is row-major and the right
    one column-major (the layout oneDNN runs fast in half precision without AVX-512)."""

    def __init__(self):
        super().__init__()
        self.layouts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2], args[-1]
            self.layouts.append((a.stride(1) == 1, b.stride(0) == 1))
        return func(*args, **(kwargs or {}))


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 16, generator=gen)
    w, b = torch.randn(12, 16, generator=gen) / 4, torch.randn(12, generator=gen)
    grad = torch.randn(3, 7, 12, generator=gen)
    leaves = [t.to(dtype).requires_grad_() for t in (x, w, b)]
    return leaves, grad.to(dtype)


def _relative(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", HALF)
def test_half_linear_matches_f_linear(emulated, dtype):
    """Forward bit-identical (the same F.linear); gradients within the dtype's rounding of the
    plain autograd's, both against an fp32 computation of the same rounded inputs."""
    ours, grad = _inputs(dtype)
    plain, _ = _inputs(dtype)
    exact = [t.detach().float().requires_grad_() for t in ours]
    out = linear(*ours)
    ref = F.linear(*plain)
    assert type(out.grad_fn).__name__ == "_HalfLinearBackward"
    assert torch.equal(out, ref)
    out.backward(grad)
    ref.backward(grad)
    F.linear(*exact).backward(grad.float())
    eps = torch.finfo(dtype).eps
    for mine, theirs, truth in zip(ours, plain, exact):
        assert mine.grad.dtype == dtype
        assert _relative(mine.grad, truth.grad) <= max(2 * eps, 2 * _relative(theirs.grad,
                                                                              truth.grad))


@pytest.mark.parametrize("dtype", HALF)
def test_half_linear_backward_uses_row_by_column_major(emulated, dtype):
    (x, w, b), grad = _inputs(dtype)
    out = linear(x, w, b)
    with _MatmulLayouts() as seen:
        out.backward(grad)
    assert seen.layouts == [(True, True), (True, True)], seen.layouts


def test_plain_f_linear_backward_is_the_slow_layout():
    """The reason for the above: autograd's own grad_input matmul is row-major x row-major."""
    (x, w, b), grad = _inputs(torch.bfloat16)
    out = F.linear(x, w, b)
    with _MatmulLayouts() as seen:
        out.backward(grad)
    assert (True, False) in seen.layouts, seen.layouts


@pytest.mark.parametrize("cpu", ["avx512", "amx"])
@pytest.mark.parametrize("dtype", HALF)
def test_native_half_precision_stays_f_linear(monkeypatch, cpu, dtype):
    """Where the CPU multiplies the dtype natively every layout is fast: no copies, autograd's
    own backward."""
    _pin_cpu(monkeypatch, cpu)
    (x, w, b), _ = _inputs(dtype)
    out = linear(x, w, b)
    assert type(out.grad_fn).__name__ != "_HalfLinearBackward"
    assert torch.equal(out, F.linear(x, w, b))


def test_fp32_and_no_grad_stay_f_linear(emulated):
    (x, w, b), _ = _inputs(torch.float32)
    assert type(linear(x, w, b).grad_fn).__name__ != "_HalfLinearBackward"
    (x, w, b), _ = _inputs(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("dtype", HALF)
def test_local_attention_in_half_precision_runs_in_fp32(emulated, dtype):
    """The local backend's training attention on CPU: the fp32 SDPA of the same inputs, cast
    back (bit-identical), gradients those of the fp32 computation cast to the dtype."""
    from plugtron.plugins.layer_backends.local import _training_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    out = _training_attention(q, k, v, is_causal=True)
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True)
    assert out.dtype == dtype and torch.equal(out, ref.to(dtype))
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(grad)
    ref.backward(grad.float())
    for mine, truth in zip((q, k, v), exact):
        assert torch.equal(mine.grad, truth.grad.to(dtype))


@pytest.mark.parametrize("cpu, dtype, in_fp32", [
    ("avx512", torch.bfloat16, True), ("avx512", torch.float16, True),
    ("amx", torch.bfloat16, False), ("amx", torch.float16, False)])
def test_local_attention_runs_in_the_dtype_with_amx(monkeypatch, cpu, dtype, in_fp32):
    """AVX-512 alone: still fp32 (its half-precision flash backward is the slower); AMX: the
    dtype's own SDPA, bit for bit, with no fp32 copies."""
    from plugtron.plugins.layer_backends.local import _training_attention

    _pin_cpu(monkeypatch, cpu)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    out = _training_attention(q, k, v, is_causal=True)
    assert (type(out.grad_fn).__name__ == "ToCopyBackward0") == in_fp32
    if not in_fp32:
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
