"""ParallelContext and comm.py collectives on 8 real gloo processes (one pool for the module)."""

import pytest
import torch
from plugtron.core.parallel import comm
from plugtron.core.parallel.context import ParallelContext, rank_groups

from tests.distributed.harness import RankFailure, worker_cache

WORLD = 8
LAYOUT = {"tp": 2, "pp": 2}  # dp 2


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(WORLD, timeout=120)


def _ctx(rank, world_size) -> ParallelContext:
    """One context per worker process: creating groups is a collective that costs time."""
    cache = worker_cache()
    if "ctx" not in cache:
        cache["ctx"] = ParallelContext.build(world_size, rank, **LAYOUT)
    return cache["ctx"]


def _layout(rank, world_size):
    ctx = _ctx(rank, world_size)
    return {"tp": ctx.tp_ranks, "pp": ctx.pp_ranks, "dp": ctx.dp_ranks, "emb": ctx.embedding_ranks,
                "tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank,
                "first": ctx.is_pipeline_first_stage(), "last": ctx.is_pipeline_last_stage(),
                "prev": ctx.pp_prev_rank, "next": ctx.pp_next_rank,
                "emb_group": ctx.in_embedding_group}


def _sums_over_groups(rank, world_size):
    """All-reduce (1 << rank) over each group: the sum's bits are exactly the members."""
    ctx = _ctx(rank, world_size)
    out = {}
    for kind in ("tp", "pp", "dp", "dp-cp", "model-parallel", "embedding", "etp", "ep", "edp"):
        t = torch.tensor([1 << rank], dtype=torch.int64)
        comm.all_reduce(t, ctx.groups[kind])
        out[kind] = [r for r in range(world_size) if int(t) >> r & 1]
    return out


def test_each_rank_knows_its_groups(pool):
    for rank, got in enumerate(pool.run(_layout)):
        assert got["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert got["pp"] == [rank % 4, rank % 4 + 4]
        assert got["dp"] == [rank - (rank >> 1 & 1) * 2 + i * 2 for i in (0, 1)]
        assert got["emb"] == got["pp"] and got["emb_group"]
        assert (got["tp_rank"], got["dp_rank"], got["pp_rank"]) == (rank % 2, rank >> 1 & 1,
                                                                    rank >> 2)
        assert got["first"] == (rank < 4) and got["last"] == (rank >= 4)
        assert got["prev"] == got["next"] == (rank + 4) % 8


def test_all_reduce_sums_over_exactly_the_group(pool):
    expected = rank_groups(WORLD, **LAYOUT)
    for rank, sums in enumerate(pool.run(_sums_over_groups)):
        for kind, members in sums.items():
            assert members == next(g for g in expected[kind] if rank in g), (rank, kind)


def _collectives(rank, world_size):
    ctx = _ctx(rank, world_size)
    tp = ctx.tp_group
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    g0 = comm.all_gather_tensor(x, tp, dim=0)
    g1 = comm.all_gather_tensor(x, tp, dim=1)
    big = torch.arange(16.0).reshape(4, 4) * (rank + 1)
    rs0 = comm.reduce_scatter_tensor(big, ctx.dp_cp_group, dim=0)
    rs1 = comm.reduce_scatter_tensor(big.t(), ctx.dp_cp_group, dim=1)  # non-contiguous input
    b = comm.broadcast(torch.tensor([float(rank)]), ctx.pp_ranks[-1], ctx.pp_group)
    single = comm.all_gather_tensor(x, None), comm.reduce_scatter_tensor(big, None)
    return g0, g1, rs0, rs1, b, single[0] is x and single[1] is big, comm.group_rank(tp)


def test_comm_collectives(pool):
    for rank, (g0, g1, rs0, rs1, b, noop, tp_rank) in enumerate(pool.run(_collectives)):
        peers = [rank - rank % 2, rank - rank % 2 + 1]
        parts = [torch.arange(6.0).reshape(2, 3) + 10 * p for p in peers]
        assert torch.equal(g0, torch.cat(parts, 0)) and torch.equal(g1, torch.cat(parts, 1))
        dp = [rank - (rank >> 1 & 1) * 2 + i * 2 for i in (0, 1)]
        total = torch.arange(16.0).reshape(4, 4) * sum(p + 1 for p in dp)
        i = dp.index(rank)
        assert torch.equal(rs0, total[2 * i:2 * i + 2])
        assert torch.equal(rs1, total.t()[:, 2 * i:2 * i + 2])
        assert b.item() == rank % 4 + 4 and noop and tp_rank == rank % 2


def _fails_on_odd_ranks(rank, world_size):
    if rank % 2:
        raise ValueError(f"bad rank {rank}")
    return rank


def test_pool_reports_rank_errors_and_stays_usable(pool):
    with pytest.raises(RankFailure) as err:
        pool.run(_fails_on_odd_ranks)
    assert sorted(err.value.tracebacks) == [1, 3, 5, 7]
    assert "ValueError: bad rank 3" in err.value.tracebacks[3]
    assert pool.run(_layout)[0]["tp"] == [0, 1]
