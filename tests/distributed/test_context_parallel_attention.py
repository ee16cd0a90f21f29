"""Context-parallel attention primitives on gloo ranks against one process's causal attention.

Each rank holds chunks r and 2cp-1-r of the same random q, k, v; its output and the gradients
of its q, k, v slices must equal the slices of a single-process computation on the full
tensors (fp32, relative 1e-5): for cp 2 and 4, each comm type, with and without GQA.
"""

import pytest
import torch
import torch.nn.functional as F
from plugtron.core.context_parallel import split_tensor
from plugtron.core.cp_attention import context_parallel_attention
from plugtron.core.parallel_context import ParallelContext

from tests.distributed.harness import DistributedPool, worker_cache

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def pool():
    with DistributedPool(4, timeout=240) as p:
        yield p


def _inputs(heads, groups, seq=16, batch=2, dim=8):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    k = torch.randn(batch, seq, groups, dim, generator=gen)
    v = torch.randn(batch, seq, groups, dim, generator=gen)
    grad = torch.randn(batch, seq, heads * dim, generator=gen)
    return q, k, v, grad


def _reference(heads, groups):
    q, k, v, grad = _inputs(heads, groups)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=heads != groups)
    out = out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _rank_attention(rank, world_size, comm_type, heads, groups):
    cache = worker_cache()
    parallel = cache.setdefault(("cp", world_size),
                                ParallelContext.build(world_size, rank, cp=world_size))
    q, k, v, grad = (split_tensor(t, 1, parallel.cp_rank, world_size)
                     for t in _inputs(heads, groups))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, parallel, comm_type)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 4)])
def test_cp_attention_equals_one_process(pool, cp, comm_type, heads, groups):
    want = _reference(heads, groups)
    results = pool.run(_rank_attention, comm_type, heads, groups, world_size=cp)
    for rank, got in enumerate(results):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            w = split_tensor(w, 1, rank, cp)
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"cp {cp} {comm_type} rank {rank} {name}: {m}")
