"""--moe-grouped-gemm picks its kernel by what runs: torch's grouped mm when a forward and
backward of it work on this device and dtype, else the padded batched matmul (the CPU path).
The grouped mm itself is replaced here by stand-ins (one that works, one that fails in backward,
none at all), so the selection is checked without a GPU; both paths equal the looped experts."""

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
