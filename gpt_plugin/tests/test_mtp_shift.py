"""Multi-token prediction's shift under context parallelism, rank by rank: at cp 2 and cp 4, each
depth's tokens, positions, labels and mask on a cp rank are exactly that rank's chunks of the
whole sequence shifted left k places (Megatron's roll_tensor k times), dtypes kept; and
``sum_over_context_parallel`` gives the cp sum forward and, backward, each share the gradient
summed over the ranks (each rank weighting the sum differently, as add_loss does). One pool of 4
ranks for the module."""

from __future__ import annotations

import pytest
import torch


def _check(rank, world_size, depth):
    import torch.distributed as dist
    from plugtron.api import split_context_parallel_batch, sum_over_context_parallel
    from plugtron_gpt.gpt.mtp import roll_left
    from plugtron_gpt.gpt.mtp_shift import ShiftedInputs, count_over_cp

    group, b, seq = dist.group.WORLD, 2, 4 * world_size
    g = torch.Generator().manual_seed(0)  # the same whole batch on every rank
    whole = {"tokens": torch.randint(1, 100, (b, seq), generator=g),
             "position_ids": torch.arange(seq).expand(b, seq),
             "labels": torch.randint(1, 100, (b, seq), generator=g),
             "loss_mask": (torch.rand(b, seq, generator=g) > 0.3).float()}
    names = list(whole)

    def mine(batch):
        return split_context_parallel_batch(batch, seq, rank, world_size)

    local = mine(whole)
    shifted = ShiftedInputs([local[n] for n in names], depth, group)
    exact = True
    for k in range(1, depth + 1):
        whole = {n: roll_left(t) for n, t in whole.items()}
        want = mine(whole)
        for name, got in zip(names, shifted.at(k)):
            exact &= got.dtype == want[name].dtype and torch.equal(got, want[name])

    w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    mask = local["loss_mask"].double()
    total = sum_over_context_parallel(w * mask.sum(), group)
    (total * (rank + 1)).backward()  # rank r weights the term r + 1
    weights = sum(range(1, world_size + 1))
    count = count_over_cp(local["loss_mask"], group)
    return {"shift": exact, "sum": total.item(), "grad": w.grad.item(),
            "want_grad": mask.sum().item() * weights, "count": count.item(),
            "want_sum": 1.5 * count.item()}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_depth_reads_the_whole_sequence_shifted(pool, cp):
    results = pool.run(_check, 3, world_size=cp)
    for rank, got in enumerate(results):
        assert got["shift"], rank
        assert got["sum"] == pytest.approx(got["want_sum"], rel=1e-12), (rank, got)
        assert got["grad"] == pytest.approx(got["want_grad"], rel=1e-12), (rank, got)
    # the whole batch's mask count, the same on every rank
    assert len({got["count"] for got in results}) == 1
