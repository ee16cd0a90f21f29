"""Expert parallelism against one process (fp32, dropout 0): every layout trains the same
losses, grad norms and aux losses (shared experts, seq/global aux losses, capacity padding,
several balancing losses at once, sqrtsoftplus scores, sinkhorn routing included); checkpoints move between expert-parallel sizes, expert tensors written once and the
expert bias kept; an fp16 overflow in one expert skips the step everywhere; the core's
all-to-all with uneven splits against a reference built on every rank.

Tolerance: relative 1e-5 per iteration (observed ~1e-7: only summation order differs).
One pool of 8 gloo ranks for the module (the kit's ``rank_pool`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from plugtron.core.checkpoint import CheckpointReader
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.training import step_info
from plugtron.testing import assert_checkpoint_reshards, assert_records_close, train_run
from plugtron.testing.config import merge_flags

RTOL = 1e-5
KEYS = ("lm_loss", "grad_norm", "load_balancing_loss", "z_loss")
MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 0.01,
       "moe-z-loss-coeff": 0.001, "train-iters": 3}


def ep(size: int, **more) -> dict:
    """A layout with expert parallelism: ep borrows from dp, so dp (the kit's world key) is
    given explicitly; ``more`` adds tp/pp/dp factors of the decoder grid."""
    dp = more.pop("dp", size)
    return {"expert-model-parallel-size": size, "dp": dp, **more}


def check(flags: dict, layout: dict, pool, keys=KEYS) -> list[dict]:
    want = train_run(flags, world_size=1, pool=pool).records
    got = train_run(merge_flags(flags, layout), pool=pool).records
    assert_records_close(got, want, RTOL, f"{layout} vs one process", keys=keys)
    return got


LAYOUTS = {
    "ep2": ep(2),
    "ep4-alltoall": {**ep(4), "moe-token-dispatcher-type": "alltoall"},
    "tp2-ep2": ep(2, tp=2),
    "tp2-sp-ep2-alltoall": {**ep(2, tp=2), "sequence-parallel": True,
                            "moe-token-dispatcher-type": "alltoall"},
    "pp2-ep2": ep(2, pp=2),
    "pp2-vp2-ep2": {**ep(2, pp=2), "virtual-pipeline-model-parallel-size": 2},
    "ep2-dp2-distributed-optimizer": {**ep(2, dp=4), "use-distributed-optimizer": True},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(name, rank_pool):
    check(MOE, LAYOUTS[name], rank_pool)


#: Model options that need their own one-process reference, each under the layout that
#: stresses it: shared experts (replicated dense MLPs, tp-split, gate weight summed over tp
#: under SP) at tp 2 x ep 2 with SP; the allgather dispatcher with SP at etp = tp; the
#: per-sequence and global-batch aux losses, whose counts reduce over tp (SP) and dp.
#: global_aux_loss (Megatron's) averages the dp-summed counts over the microbatches seen so far
#: in the global batch, so its one-process equal has the dp ranks' microbatch side by side:
#: micro-batch-size x dp (the sampler gives microbatch k of dp rank r the samples
#: k*mbs*dp + r*mbs ..., i.e. one process's k-th microbatch of mbs x dp).
SHARED = {"moe-shared-expert-intermediate-size": 24}
SP_EP = {**ep(2, tp=2), "sequence-parallel": True}  # dp 2
MODEL_LAYOUTS = {
    "shared-global-aux-tp2-sp-ep2-allgather": (
        {**SHARED, "moe-router-load-balancing-type": "global_aux_loss"},
        {**SP_EP, "moe-token-dispatcher-type": "allgather"}, {"micro-batch-size": 4}),
    "shared-gate-seq-aux-tp2-sp-ep2-alltoall": (
        {**SHARED, "moe-shared-expert-gate": True,
         "moe-router-load-balancing-type": "seq_aux_loss"},
        {**SP_EP, "moe-token-dispatcher-type": "alltoall"}, {}),
}


@pytest.mark.parametrize("name", list(MODEL_LAYOUTS))
def test_model_options_train_like_one_process(name, rank_pool):
    model, layout, reference = MODEL_LAYOUTS[name]
    flags = merge_flags(MOE, model)
    want = train_run(merge_flags(flags, reference), world_size=1, pool=rank_pool).records
    got = train_run(merge_flags(flags, layout), pool=rank_pool).records
    assert_records_close(got, want, RTOL, f"{name} vs one process", keys=KEYS)


#: Expert tensor parallelism other than tp (etp regroups tp x dp: with tp 2 and etp 1 the tp
#: ranks hold other experts, or replicas over edp). grad_norm checks that the norm counts every
#: expert element once (a tp-sum of expert norms at etp 1 would double them). (num_zeros is
#: not compared: a few fp32 gradients cancel to exactly 0 in some summation orders, etp = tp too.)
ETP_LAYOUTS = {
    "tp2-ep2-etp1-sp-alltoall": {**ep(2, tp=2), "expert-tensor-parallel-size": 1,
                                 "sequence-parallel": True,
                                 "moe-token-dispatcher-type": "alltoall"},
    "tp2-ep2-etp1-allgather": {**ep(2, tp=2), "expert-tensor-parallel-size": 1},
    "tp2-etp1-distributed-optimizer": {"tp": 2, "expert-tensor-parallel-size": 1,
                                       "use-distributed-optimizer": True},
    "dp2-etp2-alltoall": {"dp": 2, "expert-tensor-parallel-size": 2,
                          "moe-token-dispatcher-type": "alltoall"},
}


def test_expert_tensor_parallel_trains_like_one_process(rank_pool):
    want = train_run(MOE, world_size=1, pool=rank_pool).records
    for name, layout in ETP_LAYOUTS.items():
        got = train_run(merge_flags(MOE, layout), pool=rank_pool).records
        assert_records_close(got, want, RTOL, f"{name} vs one process", keys=KEYS)


@pytest.mark.parametrize("load", [{"tp": 2}, {}], ids=["tp2-etp2", "tp1"])
def test_checkpoint_saved_at_etp1_resumes_at_other_etp(load, rank_pool):
    save = {**ep(2, tp=2), "expert-tensor-parallel-size": 1, "sequence-parallel": True}
    assert_checkpoint_reshards(MOE, save_layout=save, load_layout=load, pool=rank_pool)


def test_allgather_equals_alltoall_and_grouped_equals_looped(rank_pool):
    runs = {}
    for dispatcher in ("allgather", "alltoall"):
        for grouped in (False, True):
            flags = merge_flags(MOE, ep(2), {"moe-token-dispatcher-type": dispatcher,
                                             "moe-grouped-gemm": grouped})
            runs[dispatcher, grouped] = train_run(flags, pool=rank_pool).records
    want = runs["allgather", False]
    for key, got in runs.items():
        assert_records_close(got, want, RTOL, f"{key} vs allgather looped", keys=KEYS)


def test_capacity_dropping_drops_what_one_process_drops(rank_pool):
    """With a capacity factor below what routing needs, tokens are dropped: the losses differ
    from the dropless run's and equal one process's (the same tokens were dropped)."""
    capped = merge_flags(MOE, {"moe-expert-capacity-factor": 0.5})
    dropless = train_run(MOE, world_size=1, pool=rank_pool).records
    want = train_run(capped, world_size=1, pool=rank_pool).records
    assert abs(want[0]["lm_loss"] - dropless[0]["lm_loss"]) > 1e-5
    pad = {"moe-pad-expert-input-to-capacity": True}
    for layout in (ep(2), {**ep(2), **pad},
                   {**ep(4), "moe-token-dispatcher-type": "alltoall", **pad}):
        got = train_run(merge_flags(capped, layout), pool=rank_pool).records
        assert_records_close(got, want, RTOL, f"{layout} vs one process", keys=KEYS)


def test_expert_bias_balancing_with_ep_and_dp(rank_pool):
    """Aux-loss-free balancing: the bias update sums tokens per expert over tp x dp, so it is
    the same as one process's and the runs stay equal."""
    flags = merge_flags(MOE, {"moe-router-score-function": "sigmoid",
                              "moe-router-enable-expert-bias": True,
                              "moe-router-bias-update-rate": 0.05, "moe-aux-loss-coeff": 0,
                              "train-iters": 4})
    check(flags, {**ep(2, dp=4), "moe-token-dispatcher-type": "alltoall"}, rank_pool,
          keys=("lm_loss", "grad_norm"))


def experts_written_once(ep_size: int, experts: int = 4):
    """A check of a saved checkpoint (tp 1, etp 1): each expert tensor is one piece, written by
    the expert-data-parallel rank 0 that holds the expert (global rank = its ep rank), and
    each dense tensor one piece, written by rank 0; no edp or dp replica writes a copy."""
    def check(path: str) -> None:
        writers: dict[str, list[int]] = {}
        for rank, manifest in CheckpointReader(path).manifests.items():
            for name, record in manifest["tensors"].items():
                if name.startswith("model/"):
                    writers.setdefault(name, []).extend([rank] * len(record["pieces"]))
        expert = {n: r for n, r in writers.items() if ".local_experts." in n}
        ids = {int(n.split(".local_experts.")[1].split(".")[0]): r for n, r in expert.items()}
        assert sorted(ids) == list(range(experts)), sorted(expert)
        for name, ranks in expert.items():
            e = int(name.split(".local_experts.")[1].split(".")[0])
            assert ranks == [e // (experts // ep_size)], (name, ranks)
        for name, ranks in writers.items():
            assert name in expert or ranks == [0], (name, ranks)
    return check


#: Aux-loss-free balancing: the routers' expert_bias is saved and resumed (a bias lost on
#: resume changes the routing, so the resumed losses would differ).
EXPERT_BIAS = {"moe-router-score-function": "sigmoid", "moe-router-enable-expert-bias": True,
               "moe-router-bias-update-rate": 0.05}


@pytest.mark.parametrize("load", [{}, ep(4)], ids=["ep1", "ep4"])
def test_checkpoint_saved_at_ep2_resumes_at_other_ep(load, rank_pool):
    assert_checkpoint_reshards(merge_flags(MOE, EXPERT_BIAS), save_layout=ep(2),
                               load_layout=load, pool=rank_pool, inspect=experts_written_once(2))


def test_checkpoint_moves_with_distributed_optimizer(rank_pool):
    """Saved at ep 2 x edp 2: the experts' replicas on edp rank 1 write nothing."""
    flags = merge_flags(MOE, {"use-distributed-optimizer": True})
    assert_checkpoint_reshards(flags, save_layout=ep(2, dp=4), load_layout=ep(4),
                               pool=rank_pool, inspect=experts_written_once(2))


# --------------------------------------------------------------------------- core all_to_all


def _rows(src: int, dst: int, n: int) -> torch.Tensor:
    """The rows rank ``src`` sends rank ``dst`` (any rank can build them: the gathered
    reference), and the weights rank ``dst`` puts on them in the test's loss."""
    g = torch.Generator().manual_seed(100 * src + dst)
    return torch.randn(n, 3, generator=g, dtype=torch.float64)


def _split(src: int, dst: int) -> int:
    return (src + 2 * dst) % 3  # uneven, zeros included


def _check_all_to_all(rank, world_size):
    """Forward: the rows each rank receives are what the others sent it, in rank order.
    Backward: each sender gets the gradient of the rows it sent. Bad splits: a ValueError."""
    import torch.distributed as dist
    from plugtron.api import all_to_all, all_to_all_counts

    group, n = dist.group.WORLD, world_size
    sends = [_split(rank, j) for j in range(n)]
    recvs = [_split(j, rank) for j in range(n)]
    x = torch.cat([_rows(rank, j, sends[j]) for j in range(n)]).requires_grad_()
    out = all_to_all(x, group, recvs, sends)
    want = torch.cat([_rows(j, rank, recvs[j]) for j in range(n)])
    weights = torch.cat([_rows(j, rank, recvs[j]).flip(1) for j in range(n)])
    (out * weights).sum().backward()
    # rank j put weights _rows(rank, j).flip(1) on the rows this rank sent it
    want_grad = torch.cat([_rows(rank, j, sends[j]).flip(1) for j in range(n)])
    counts = torch.tensor([[rank, j] for j in range(n)])
    errors = []
    for bad in ([sends, recvs[:-1]], [sends[:-1] + [sends[-1] + 1], recvs], [None, recvs]):
        try:
            all_to_all(x.detach(), group, bad[1], bad[0])
        except ValueError as exc:
            errors.append(str(exc))
    return {"forward": torch.equal(out.detach(), want), "backward": torch.equal(x.grad, want_grad),
            "counts": all_to_all_counts(counts, group).tolist(), "errors": errors}


def test_core_all_to_all_uneven_splits_forward_backward_and_errors(rank_pool):
    n = 4
    for rank, got in enumerate(rank_pool.run(_check_all_to_all, world_size=n)):
        assert got["forward"] and got["backward"], (rank, got)
        assert got["counts"] == [[j, rank] for j in range(n)]  # row j: what rank j had for me
        assert len(got["errors"]) == 3, got["errors"]
        assert "do not fit" in got["errors"][0] and "do not fit" in got["errors"][1]
        assert "give both" in got["errors"][2]


# --------------------------------------------------------------------------- fp16 found-inf


class InfInOneExpert:
    """Extension plugin: at ``iteration``, the gradient of one expert weight of ep rank 1
    (the only rank holding that expert) becomes inf, a forced fp16 overflow."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    @hookimpl
    def plugtron_model_built(self, config, model_chunks, parallel):
        if parallel.ep_rank != 1:
            return
        param = next(p for chunk in model_chunks for name, p in chunk.named_parameters()
                     if ".experts." in name)
        param.register_hook(lambda g: g * float("inf")
                            if step_info.current.iteration == self.iteration else g)


def test_fp16_overflow_in_an_expert_skips_the_step_on_every_rank(rank_pool):
    """The inf is in a gradient only ep rank 1 has; the step is skipped everywhere: the
    parameters after it (ep rank 0's dense ones, ep rank 1's experts) equal those of a run
    stopped before it."""
    flags = merge_flags(MOE, ep(2), {"fp16": True, "initial-loss-scale": 256.0,
                                     "hysteresis": 1})
    skipped = train_run(flags, pool=rank_pool, plugins=[InfInOneExpert(3)], gather_params=True)
    before = train_run(flags, pool=rank_pool, stop_at=2, gather_params=True)
    assert [r["skipped"] for r in skipped.records] == [False, False, True]
    assert [r["loss_scale"] for r in skipped.records] == [256.0, 256.0, 128.0]
    assert skipped.params.keys() == before.params.keys()
    assert any(".experts." in name for name in skipped.params)
    for name, value in skipped.params.items():
        assert torch.equal(value, before.params[name]), name


def test_the_dispatcher_kit_check_passes_the_built_in_alltoall(rank_pool):
    from plugtron_moe.testing import assert_dispatcher_matches

    assert_dispatcher_matches("alltoall", layouts=[{"expert-model-parallel-size": 2, "dp": 2}],
                              pool=rank_pool)


#: Megatron-Core 0.19 router options (issue 27): several balancing losses at once with
#: sqrtsoftplus scores under tp 2 x sp x ep 2 (each loss's counts reduce over tp as the single
#: ones do; the microbatches are one process's, so mbs stays), and sinkhorn routing at ep 2
#: (balanced over each rank's own microbatch, which is one process's microbatch here).
ROUTER_LAYOUTS = {
    "sqrtsoftplus-aux-and-seq-tp2-sp-ep2-alltoall": (
        {"moe-router-score-function": "sqrtsoftplus",
         "moe-router-load-balancing-type": ["aux_loss", "seq_aux_loss"],
         "moe-aux-loss-coeff": [0.01, 0.001]},
        {**SP_EP, "moe-token-dispatcher-type": "alltoall"},
        KEYS + ("seq_load_balancing_loss",)),
    "sinkhorn-ep2": ({"moe-router-load-balancing-type": "sinkhorn", "moe-aux-loss-coeff": 0},
                     ep(2), ("lm_loss", "grad_norm", "z_loss")),
}


@pytest.mark.parametrize("name", list(ROUTER_LAYOUTS))
def test_router_options_train_like_one_process(name, rank_pool):
    model, layout, keys = ROUTER_LAYOUTS[name]
    flags = merge_flags(MOE, model)
    want = train_run(flags, world_size=1, pool=rank_pool).records
    assert all(key in want[0] for key in keys), (keys, want[0])
    got = train_run(merge_flags(flags, layout), pool=rank_pool).records
    assert_records_close(got, want, RTOL, f"{name} vs one process", keys=keys)
