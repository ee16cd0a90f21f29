"""Context-parallel attention primitives on gloo ranks against one process's causal attention.

Each rank holds chunks r and 2cp-1-r of the same random q, k, v; its output and the gradients
of its q, k, v slices must equal the slices of a single-process computation on the full
tensors (fp32, relative 1e-5): for cp 2 and 4, each comm type, with and without GQA, and at
cp 2 with values narrower than the keys (multi-latent attention). The same
runs count the bytes autograd keeps for backward (the attention activations): per rank within
1.2x of 1/cp of one process's. With attention dropout, p2p and allgather must equal one process
applying the same positional mask (attention_blocks.keep_mask) to the full attention.
"""

import pytest
import torch
import torch.nn.functional as F
from plugtron.core.parallel.attention_blocks import draw_dropout, keep_mask
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.context_parallel import (
    chunk_order,
    rank_positions,
    split_context_parallel_batch,
    split_tensor,
    take_positions,
)
from plugtron.core.parallel.cp_attention import context_parallel_attention

from tests.distributed.harness import worker_cache

RTOL, ATOL = 1e-5, 1e-6
MEMORY_SLACK = 1.2  # the goal: activations per rank within 1.2x of 1/cp
DROPOUT, DROPOUT_SEED = 0.3, 11


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4, timeout=240)


def _inputs(heads, groups, seq=16, batch=2, dim=8):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, seq, heads, dim, generator=gen)
    k = torch.randn(batch, seq, groups, dim, generator=gen)
    v = torch.randn(batch, seq, groups, dim, generator=gen)
    grad = torch.randn(batch, seq, heads * dim, generator=gen)
    return q, k, v, grad


def saved_bytes(fn):
    """(fn(), bytes autograd saved for backward while it ran, each storage counted once)."""
    seen = set()

    def pack(t):
        storage = t.untyped_storage()
        seen.add((storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(nbytes for _, nbytes in seen)


def _reference(heads, groups, dropout_p=0.0):
    q, k, v, grad = _inputs(heads, groups)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if dropout_p:  # the positional mask applied to the full attention, by hand
        torch.manual_seed(DROPOUT_SEED)
        dropout = draw_dropout(dropout_p, "cpu")
        kt, vt = (t.repeat_interleave(heads // groups, dim=1) for t in (kt, vt))
        seq = q.shape[1]
        scores = (qt @ kt.transpose(-1, -2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -torch.inf)
        pos = torch.arange(seq)
        keep = keep_mask(dropout, q.shape[0], heads, pos, pos)
        out = (scores.softmax(-1) * keep / (1 - dropout_p)) @ vt
        memory = 0
    else:
        out, memory = saved_bytes(lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, enable_gqa=heads != groups))
    out = out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)
    out.backward(grad)
    return (out.detach(), q.grad, k.grad, v.grad), memory


def _rank_attention(rank, world_size, comm_type, heads, groups, dropout_p=0.0):
    cache = worker_cache()
    parallel = cache.setdefault(("cp", world_size),
                                ParallelContext.build(world_size, rank, cp=world_size))
    q, k, v, grad = (split_tensor(t, 1, parallel.cp_rank, world_size)
                     for t in _inputs(heads, groups))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(DROPOUT_SEED)  # cp ranks share the dropout stream, as in training
    out, memory = saved_bytes(lambda: context_parallel_attention(q, k, v, parallel, comm_type,
                                                                 dropout_p))
    out.backward(grad)
    return (out.detach(), q.grad, k.grad, v.grad), memory


def _check(results, want, cp, what):
    for rank, (got, _) in enumerate(results):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            w = split_tensor(w, 1, rank, cp)
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what} rank {rank} {name}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 4)])
def test_cp_attention_equals_one_process(pool, cp, comm_type, heads, groups):
    want, memory = _reference(heads, groups)
    results = pool.run(_rank_attention, comm_type, heads, groups, world_size=cp)
    _check(results, want, cp, f"cp {cp} {comm_type}")
    for rank, (_, saved) in enumerate(results):
        ratio = saved / (memory / cp)
        assert ratio <= MEMORY_SLACK, (f"cp {cp} {comm_type} rank {rank}: saves {saved} bytes "
                                       f"for backward, {ratio:.2f}x of 1/cp of one process's "
                                       f"{memory}")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_attention_dropout_equals_one_process_with_the_same_mask(pool, cp, comm_type):
    want, _ = _reference(8, 4, DROPOUT)
    results = pool.run(_rank_attention, comm_type, 8, 4, DROPOUT, world_size=cp)
    _check(results, want, cp, f"dropout cp {cp} {comm_type}")


def test_the_positional_dropout_mask_is_bernoulli():
    dropout = draw_dropout(DROPOUT, "cpu")
    pos = torch.arange(256)
    keep = keep_mask(dropout, 2, 8, pos, pos).float()
    assert abs(keep.mean().item() - (1 - DROPOUT)) < 0.005
    # Neighbouring rows, columns and heads are not copies of each other.
    for a, b in ((keep[:, :, 1:], keep[:, :, :-1]), (keep[..., 1:], keep[..., :-1]),
                 (keep[:, 1:], keep[:, :-1])):
        assert abs((a == b).float().mean().item() - (0.7 ** 2 + 0.3 ** 2)) < 0.01
    again = keep_mask(dropout, 2, 8, pos[100:110], pos[:50]).float()
    assert torch.equal(again, keep[:, :, 100:110, :50])


def _rank_a2a_dropout_pattern(rank, world_size, seq=16, heads=4):
    """q = k = 0 (uniform causal probabilities) and v = one-hot key positions: the output of
    each head is its dropout mask row by row."""
    cache = worker_cache()
    parallel = cache.setdefault(("cp", world_size),
                                ParallelContext.build(world_size, rank, cp=world_size))
    q = torch.zeros(1, seq, heads, seq)
    v = torch.eye(seq).expand(1, heads, seq, seq).transpose(1, 2)
    local = [split_tensor(t, 1, parallel.cp_rank, world_size) for t in (q, q, v)]
    torch.manual_seed(DROPOUT_SEED)
    out = context_parallel_attention(*local, parallel, "a2a", 0.5)
    return out.view(1, seq // world_size, heads, seq) > 0


def test_a2a_dropout_masks_differ_between_head_blocks(pool):
    kept = pool.run(_rank_a2a_dropout_pattern, world_size=2)
    # Head 0 went through rank 0's attention, head 2 through rank 1's: not the same mask.
    for rank_kept in kept:
        assert not torch.equal(rank_kept[..., 0, :], rank_kept[..., 2, :])


def _narrow_inputs(heads=4, v_dim=5, seq=16, batch=2, dim=8):
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, seq, heads, v_dim, generator=gen)
    return q, k, v, torch.randn(batch, seq, heads * v_dim, generator=gen)


def _rank_narrow_values(rank, world_size, comm_type):
    cache = worker_cache()
    parallel = cache.setdefault(("cp", world_size),
                                ParallelContext.build(world_size, rank, cp=world_size))
    q, k, v, grad = (split_tensor(t, 1, parallel.cp_rank, world_size) for t in _narrow_inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, parallel, comm_type)
    out.backward(grad)
    return (out.detach(), q.grad, k.grad, v.grad), 0


@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_values_narrower_than_keys_equal_one_process(pool, comm_type):
    """Multi-latent attention's shape (issue 27): 5 value channels against 8 query/key ones.
    p2p and allgather carry the values zero-padded to the key width; a2a as they are."""
    q, k, v, grad = _narrow_inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         is_causal=True)
    out = out.transpose(1, 2).reshape(2, 16, -1)
    out.backward(grad)
    want = (out.detach(), q.grad, k.grad, v.grad)
    results = pool.run(_rank_narrow_values, comm_type, world_size=2)
    _check(results, want, 2, f"narrow values cp 2 {comm_type}")


# --------------------------------------------------------------------------- packed documents

#: Document numbers of the 16 positions of each sample: documents cross the cp chunks (4 or 8
#: tokens each), a one-token document included, and the two samples differ.
DOCUMENTS = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 3, 3, 3],
                          [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2]])


def _reference_documents(heads, groups):
    """One process, each document's tokens attending to earlier tokens of that document."""
    q, k, v, grad = _inputs(heads, groups)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    seq = q.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril() & \
        (DOCUMENTS[:, :, None] == DOCUMENTS[:, None, :])
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         attn_mask=mask[:, None], enable_gqa=heads != groups)
    out = out.transpose(1, 2).reshape(q.shape[0], seq, -1)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _rank_documents(rank, world_size, comm_type, heads, groups):
    cache = worker_cache()
    parallel = cache.setdefault(("cp", world_size),
                                ParallelContext.build(world_size, rank, cp=world_size))
    q, k, v, grad = (split_tensor(t, 1, parallel.cp_rank, world_size)
                     for t in _inputs(heads, groups))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, parallel, comm_type, 0.0, DOCUMENTS)
    out.backward(grad)
    return (out.detach(), q.grad, k.grad, v.grad), 0


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_packed_documents_under_cp_equal_one_process(pool, cp, comm_type):
    """The whole sequence's document numbers reach every comm type: a query sees only earlier
    keys of its own document, on whichever rank they live (fp32, relative 1e-5)."""
    want = _reference_documents(8, 4)
    results = pool.run(_rank_documents, comm_type, 8, 4, world_size=cp)
    _check(results, want, cp, f"documents cp {cp} {comm_type}")
    assert all(torch.isfinite(t).all() for got, _ in results for t in got)


#: Documents whose lengths are multiples of 2 x cp: each is cut in 2 x cp parts (Megatron's THD
#: split under cp). The samples differ; cp 4's second sample is one document.
DOCUMENTS_BY_PARTS = {
    2: torch.tensor([[0] * 4 + [1] * 8 + [2] * 4, [0] * 12 + [1] * 4]),
    4: torch.tensor([[0] * 8 + [1] * 8, [0] * 16]),
}


def _reference_by_parts(heads, groups, documents, dropout_p):
    """One process with the positional dropout mask applied by hand (as :func:`_reference`)."""
    q, k, v, grad = _inputs(heads, groups)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    seq = q.shape[1]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = (t.repeat_interleave(heads // groups, dim=1) for t in (kt, vt))
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril() & \
        (documents[:, :, None] == documents[:, None, :])
    scores = ((qt @ kt.transpose(-1, -2)) / q.shape[-1] ** 0.5).masked_fill(
        ~allowed[:, None], -torch.inf)
    probs = scores.softmax(-1)
    if dropout_p:
        torch.manual_seed(DROPOUT_SEED)
        pos = torch.arange(seq)
        probs = probs * keep_mask(draw_dropout(dropout_p, "cpu"), q.shape[0], heads, pos, pos) \
            / (1 - dropout_p)
    out = (probs @ vt).transpose(1, 2).reshape(q.shape[0], seq, -1)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _rank_by_parts(rank, world_size, comm_type, heads, groups, dropout_p):
    cache = worker_cache()
    parallel = cache.setdefault(("cp", world_size),
                                ParallelContext.build(world_size, rank, cp=world_size))
    documents = DOCUMENTS_BY_PARTS[world_size]
    q, k, v, grad = _inputs(heads, groups)
    batch = split_context_parallel_batch({"q": q, "k": k, "v": v, "grad": grad,
                                          "attention_mask": documents}, 16, rank, world_size)
    q, k, v = (batch[n].clone().requires_grad_() for n in "qkv")
    torch.manual_seed(DROPOUT_SEED)
    out = context_parallel_attention(q, k, v, parallel, comm_type, dropout_p, documents)
    out.backward(batch["grad"])
    return (out.detach(), q.grad, k.grad, v.grad), 0


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type,dropout_p", [("p2p", 0.0), ("allgather", 0.0),
                                                 ("a2a", 0.0), ("p2p", DROPOUT),
                                                 ("allgather", DROPOUT)])
def test_documents_cut_in_parts_under_cp_equal_one_process(pool, cp, comm_type, dropout_p):
    """Each document cut in 2 x cp parts, rank r holding parts r and 2cp-1-r of every one: every
    comm type (and the positional dropout mask) equals one process (fp32, relative 1e-5)."""
    documents = DOCUMENTS_BY_PARTS[cp]
    want = _reference_by_parts(8, 4, documents, dropout_p)
    results = pool.run(_rank_by_parts, comm_type, 8, 4, dropout_p, world_size=cp)
    order = chunk_order(documents, 16, cp)
    # A document's first query sees one key: its dq is 0 on one process and the rounding of
    # (dP - delta) * P ~ 1e-6 blockwise, which the dropout mask's 1/(1-p) scales up.
    atol = 5 * ATOL if dropout_p else ATOL
    for rank, (got, _) in enumerate(results):
        mine = rank_positions(order, rank, cp)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g, take_positions(w, mine), rtol=RTOL, atol=atol,
                                       msg=lambda m: f"cp {cp} {comm_type} rank {rank} {name}: {m}")


def _attention_pairs(documents, positions):
    """Query-key pairs a rank computes: its queries against earlier keys of their document."""
    seq = documents.shape[1]
    before = torch.arange(seq)[None, :] <= positions[..., :, None]  # [b, n, seq]
    same = documents.gather(1, positions)[..., None] == documents[:, None, :]
    return int((before & same).sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_cutting_each_document_balances_attention_work(cp):
    """One long document and short ones: cut as a whole sequence, the rank holding the long
    document's end does most of the work; cut per document, every rank does the same."""
    documents = torch.tensor([[0] * 48 + [1] * 8 + [2] * 8])
    seq = documents.shape[1]
    whole = [_attention_pairs(documents, rank_positions(torch.arange(seq)[None], r, cp))
             for r in range(cp)]
    parts = [_attention_pairs(documents, rank_positions(chunk_order(documents, seq, cp), r, cp))
             for r in range(cp)]
    assert len(set(parts)) == 1 and sum(parts) == sum(whole)
    assert max(whole) > min(whole) * 1.2, whole
    mixed = torch.tensor([[0] * 48 + [1] * 8 + [2] * 7 + [3]])  # a length not a multiple
    assert torch.equal(chunk_order(mixed, seq, cp), torch.arange(seq)[None])
