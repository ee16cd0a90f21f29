"""--moe-grouped-gemm picks its kernel by what runs: torch's grouped mm when a forward and
backward of it work on this device and dtype (CPU fp32 and bf16 with torch 2.13), else the
padded batched matmul. The grouped mm is replaced by stand-ins (one that works, one that fails in
backward, none at all) to check the selection, and run as torch has it on CPU; every path equals
the looped experts."""

from __future__ import annotations

import pytest
import torch
from plugtron.api import ParallelContext
from plugtron_moe import experts as ex

from tests.utils import tiny_config


def _working_grouped_mm(calls):
    def grouped_mm(a, b, offs):
        calls.append(tuple(b.shape))
        starts = [0, *offs.tolist()[:-1]]
        return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(starts, offs.tolist()))])
    return grouped_mm


def _fails_in_backward(a, b, offs):
    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("no backward for grouped mm on this device")
    return Fail.apply(_working_grouped_mm([])(a, b, offs))


@pytest.fixture
def experts_and_tokens(monkeypatch):
    monkeypatch.setattr(ex, "_GROUPED_MM_RUNS", {})
    config = tiny_config(num_experts=3, moe_router_topk=1, moe_router_pre_softmax=True,
                         moe_ffn_hidden_size=16)
    parallel = ParallelContext.build(1, 0)
    mlps = [ex.ExpertMLP(config, parallel, f"e.{i}", 0) for i in range(3)]
    tokens = torch.randn(10, 32)
    counts = [4, 0, 6]
    looped = torch.cat([m(c) for m, c in zip(mlps, tokens.split(counts))])
    return mlps, tokens, counts, looped


@pytest.mark.parametrize("kind", ["works", "fails-in-backward", "absent"])
def test_grouped_mm_is_used_only_where_it_runs(kind, experts_and_tokens, monkeypatch):
    mlps, tokens, counts, looped = experts_and_tokens
    calls = []
    if kind == "absent":
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    else:
        stand_in = _working_grouped_mm(calls) if kind == "works" else _fails_in_backward
        monkeypatch.setattr(torch, "_grouped_mm", stand_in, raising=False)
    assert ex.grouped_mm_runs(tokens.device, tokens.dtype) is (kind == "works")
    probe_calls = len(calls)
    out = ex.grouped_forward(mlps, tokens, counts)
    torch.testing.assert_close(out, looped, rtol=1e-6, atol=1e-6)
    assert len(calls) - probe_calls == (2 if kind == "works" else 0)  # fc1 and fc2


def test_the_probe_runs_once_per_device_and_dtype(monkeypatch):
    monkeypatch.setattr(ex, "_GROUPED_MM_RUNS", {})
    calls = []
    monkeypatch.setattr(torch, "_grouped_mm", _working_grouped_mm(calls), raising=False)
    for _ in range(3):
        assert ex.grouped_mm_runs(torch.device("cpu"), torch.float32)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_grouped_mm_runs_on_cpu_and_equals_the_looped_experts(dtype, monkeypatch):
    """torch 2.13's own grouped mm on CPU, forward and backward, with a broadcast gradient
    (``out.sum()``, which its backward refuses unless made dense): the same output and
    gradients as the looped experts, within 1e-6 in fp32 (equal here; another CPU's kernels may
    sum in another order) and to its rounding in bf16."""
    if getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped mm")
    monkeypatch.setattr(ex, "_GROUPED_MM_RUNS", {})
    assert ex.grouped_mm_runs(torch.device("cpu"), dtype)
    config = tiny_config(num_experts=3, moe_router_topk=1, moe_router_pre_softmax=True,
                         moe_ffn_hidden_size=16, swiglu=True)
    parallel = ParallelContext.build(1, 0)
    mlps = [ex.ExpertMLP(config, parallel, f"e.{i}", 0).to(dtype) for i in range(3)]
    counts = [4, 0, 12]
    runs = []
    for grouped in (False, True):
        for m in mlps:
            m.zero_grad()
        tokens = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
        tokens.requires_grad_()
        out = ex.grouped_forward(mlps, tokens, counts) if grouped else \
            torch.cat([m(c) for m, c in zip(mlps, tokens.split(counts))])
        out.sum().backward()
        runs.append((out.detach(), tokens.grad, [p.grad.clone() for m in mlps
                                                 for p in m.parameters()]))
    tol = {} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    (o1, g1, p1), (o2, g2, p2) = runs
    torch.testing.assert_close(o2, o1, **tol)
    torch.testing.assert_close(g2, g1, **tol)
    for a, b in zip(p2, p1):
        torch.testing.assert_close(a, b, **tol)
