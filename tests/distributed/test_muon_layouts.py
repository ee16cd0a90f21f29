"""``--optimizer muon`` under every layout it supports against one process (fp32, the
Newton-Schulz iteration in fp32 too: ``--muon-fp32-matmul-prec high``), on one pool of 4 gloo
ranks: tp 2 duplicated (with and without sequence parallelism) and distributed, the layer-wise sharded mode at
dp 2 and dp 4 (state per rank ~1/dp), pp 2, vp, cp, MoE experts over ep, MLA, Hybrid, bf16
with fp32 main parameters, recompute with gradient accumulation and clipping, checkpoints
that resume bitwise, into another dp size and bit for bit through tp 2 x dp 2 -> layer-wise
dp 4 -> fsdp2 dp 4 -> tp 2 x dp 2, and ``plugtron estimate``'s optimizer state against the
measured bytes.

Tolerance 1e-5 (relative on losses and grad norms, atol + rtol on every final parameter): only
the order of fp32 sums differs from one process. In bf16 (``medium``, the default) the
iteration rounds those differences to bf16 steps; the figure is in docs/plugins/optimizers.md.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from plugtron.core.checkpoint import checkpointer, load_if_requested
from plugtron.core.checkpoint.layout import iteration_dirname
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.tools.estimate import estimate_memory
from plugtron.core.training.loop import setup, train
from plugtron.testing import assert_checkpoint_reshards, make_config, read_checkpoint
from plugtron.testing.compare import (
    assert_copies_match,
    assert_params_close,
    assert_records_close,
)
from plugtron.testing.config import merge_flags
from plugtron.testing.layouts import layout_name
from plugtron.testing.runs import train_run

FLAGS = {"optimizer": "muon", "muon-fp32-matmul-prec": "high", "lr": 5e-3, "train-iters": 3}
LAYER_WISE = {"use-distributed-optimizer": True}
#: The Newton-Schulz iteration on the tp shards, its Gram matrices summed over tp.
DISTRIBUTED = {"muon-tp-mode": "distributed"}
TOL = 1e-5


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4, timeout=300)


@pytest.fixture(scope="module")
def reference(pool):
    return train_run(FLAGS, 1, pool, gather_params=True)


@pytest.mark.parametrize("layout", [
    {"tp": 2}, {"tp": 2, "sequence-parallel": True}, {"dp": 2, **LAYER_WISE},
    {"dp": 4, **LAYER_WISE}, {"pp": 2}, {"tp": 2, "dp": 2, **LAYER_WISE},
    {"pp": 2, "vp": 2}, {"cp": 2, "dp": 2, **LAYER_WISE}, {"dp": 2, "use-torch-fsdp2": True},
    {"tp": 2, "dp": 2, "use-torch-fsdp2": True}, {"tp": 2, **DISTRIBUTED},
], ids=["tp2", "tp2-sp", "dp2-layer-wise", "dp4-layer-wise", "pp2", "tp2-dp2-layer-wise",
        "pp2-vp2", "cp2-dp2-layer-wise", "fsdp2-dp2", "tp2-fsdp2-dp2", "tp2-distributed"])
def test_layout_steps_like_one_process(pool, reference, layout):
    _assert_like_one_process(pool, FLAGS, layout, reference)


#: Models and training settings other than the kit's GPT, each under the layouts that matter
#: for it: MoE experts over ep (whole per expert, over edp when layer-wise; over etp when
#: duplicated), MLA, Hybrid (Mamba), bf16 with fp32 main parameters, full recompute with
#: gradient accumulation and a clipping global norm, QK-clip (its q and k rows scaled every step;
#: MLA's per head, its heads split over tp; under fsdp2 on each rank's shard of the rows;
#: under cp with the keys of every cp rank).
MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-ffn-hidden-size": 16, "swiglu": True,
       "moe-layer-freq": "([0]*1+[1]*3)"}
MLA = {"multi-latent-attention": True, "kv-lora-rank": 8, "qk-head-dim": 6,
       "qk-pos-emb-head-dim": 4, "v-head-dim": 5, "q-lora-rank": 12,
       "position-embedding-type": "rope", "normalization": "RMSNorm", "add-bias-linear": False}
HYBRID = {"model": "hybrid", "mamba-state-dim": 8, "mamba-head-dim": 8, "mamba-num-groups": 2,
          "mamba-chunk-size": 6, "normalization": "RMSNorm", "hybrid-layer-pattern": "M*-M"}
RECOMPUTE_CLIP = {"recompute-granularity": "full", "recompute-method": "uniform",
                  "recompute-num-layers": 1, "clip-grad": 0.05, "micro-batch-size": 1}
#: Low enough that every step clips (the tiny model's logits are small).
QK_CLIP = {"qk-clip": True, "qk-clip-threshold": 0.01}
VARIANTS = {
    "moe-ep2-dp2-layer-wise": (MOE, {"expert-model-parallel-size": 2, "dp": 2, **LAYER_WISE}),
    "moe-tp2-ep2-dp2": (MOE, {"tp": 2, "expert-model-parallel-size": 2, "dp": 2}),
    "moe-tp2-ep2-dp2-distributed": (MOE, {"tp": 2, "expert-model-parallel-size": 2, "dp": 2,
                                          **DISTRIBUTED}),
    "mla-tp2": (MLA, {"tp": 2}),
    "hybrid-tp2": (HYBRID, {"tp": 2}),
    "hybrid-dp2-layer-wise": (HYBRID, {"dp": 2, **LAYER_WISE}),
    "bf16-dp2-layer-wise": ({"bf16": True}, {"dp": 2, **LAYER_WISE}),
    "recompute-clip-accumulate-dp2-layer-wise": (RECOMPUTE_CLIP, {"dp": 2, **LAYER_WISE}),
    "qk-clip-tp2": (QK_CLIP, {"tp": 2}),
    "qk-clip-pp2-dp2-layer-wise": (QK_CLIP, {"pp": 2, "dp": 2, **LAYER_WISE}),
    "mla-qk-clip-tp2": ({**MLA, **QK_CLIP}, {"tp": 2}),
    "qk-clip-tp2-fsdp2-dp2": (QK_CLIP, {"tp": 2, "dp": 2, "use-torch-fsdp2": True}),
    "qk-clip-cp2-dp2-layer-wise": (QK_CLIP, {"cp": 2, "dp": 2, **LAYER_WISE}),
}
_references: dict = {}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_and_settings_step_like_one_process(pool, variant):
    model, layout = VARIANTS[variant]
    flags = merge_flags(FLAGS, model)
    key = repr(sorted(flags.items()))
    if key not in _references:
        _references[key] = train_run(flags, 1, pool, gather_params=True)
    _assert_like_one_process(pool, flags, layout, _references[key])


def _assert_like_one_process(pool, flags, layout, reference):
    got = train_run(merge_flags(flags, layout), None, pool, gather_params=True)
    what = f"muon {layout} against one process"
    assert_records_close(got.records, reference.records, TOL, what)
    assert_params_close(assert_copies_match(got.params, TOL, TOL, what), reference.params, TOL,
                        TOL, what)


def _state_bytes(rank, world_size, flags):
    """Bytes of optimizer state on this rank after training (run in each rank of the pool)."""
    config = make_config(flags)
    run = setup(config)
    train(run, MetricsLogger(config, rank=1))
    return run.optimizer.state_bytes()


def test_layer_wise_state_is_split_over_dp(pool):
    whole, = pool.run(_state_bytes, merge_flags(FLAGS, {"train-iters": 1}), world_size=1)
    split = pool.run(_state_bytes, merge_flags(FLAGS, LAYER_WISE, {"train-iters": 1}),
                     world_size=4)
    assert sum(split) == whole
    assert max(split) < 1.35 * whole / 4, (split, whole)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, LAYER_WISE),
                                         (2, {**LAYER_WISE, "bf16": True})],
                         ids=["one-process", "dp2-layer-wise", "bf16-dp2-layer-wise"])
def test_the_estimate_is_the_measured_state(pool, world, layout):
    """``plugtron estimate``'s optimizer state, in bytes, is what the fullest rank holds after a
    step: Muon's momentum for the matrices, AdamW's two moments for the rest, the fp32 main
    copies under bf16, each parameter on the rank that steps it."""
    flags = merge_flags(FLAGS, layout, {"train-iters": 1})
    measured = pool.run(_state_bytes, flags, world_size=world)
    estimate, = estimate_memory(make_config(flags), world).ranks
    assert estimate.optimizer_selected == max(measured), (estimate.optimizer_selected, measured)


def test_blockwise_is_an_approximation(pool, reference):
    got = train_run(merge_flags(FLAGS, {"tp": 2, "muon-tp-mode": "blockwise"}), None, pool)
    assert got.records[-1]["lm_loss"] < got.records[0]["lm_loss"]
    assert got.records[-1]["lm_loss"] != pytest.approx(reference.records[-1]["lm_loss"],
                                                       rel=TOL)


def test_layer_wise_resumes_bitwise(pool):
    flags = merge_flags(FLAGS, LAYER_WISE, {"dp": 2, "train-iters": 4})
    with tempfile.TemporaryDirectory() as save:
        continuous = train_run(merge_flags(flags, {"save": save, "save-interval": 2}), 2, pool)
        resumed = train_run(merge_flags(flags, {"load": os.path.join(
            save, iteration_dirname(2))}), 2, pool)
    assert [(r["lm_loss"], r["grad_norm"]) for r in resumed.records] == \
        [(r["lm_loss"], r["grad_norm"]) for r in continuous.records[2:]]


@pytest.mark.parametrize("save,load", [({"dp": 2, **LAYER_WISE}, {"dp": 4, **LAYER_WISE}),
                                       ({"tp": 2}, {"dp": 2, **LAYER_WISE}),
                                       ({"dp": 4, **LAYER_WISE},
                                        {"dp": 4, "use-torch-fsdp2": True})],
                         ids=["dp2-to-dp4-layer-wise", "tp2-to-dp2-layer-wise",
                              "dp4-layer-wise-to-fsdp2-dp4"])
def test_muon_state_reshards_across_layouts(pool, save, load):
    assert_checkpoint_reshards(FLAGS, save, load, pool=pool)


def _resave(rank, world_size, flags):
    """Load ``--load`` under this layout and save it again at once, untouched by a step (run
    in each rank of the pool)."""
    run = setup(make_config(flags))
    load_if_requested(run)
    checkpointer(run).save(async_save=False)
    checkpointer(run).wait()


#: tp 2 x dp 2 (the iteration duplicated over tp) -> layer-wise dp 4 (each parameter's state
#: on its owner) -> fsdp2 dp 4 (the state as DTensor shards) -> back to tp 2 x dp 2.
RESHARD_CHAIN = [{"tp": 2, "dp": 2}, {"dp": 4, **LAYER_WISE}, {"dp": 4, "use-torch-fsdp2": True},
                 {"tp": 2, "dp": 2}]


def test_muon_state_reshards_through_the_layouts_bitwise(pool):
    """A checkpoint goes through every layout of :data:`RESHARD_CHAIN`, each loading the one
    before and saving it again: every tensor each saves, read whole (Muon's momentum, AdamW's
    two moments, the weights), is the first one's, bit for bit."""
    flags = merge_flags(FLAGS, {"train-iters": 2})
    with tempfile.TemporaryDirectory() as root:
        first = os.path.join(root, "0")
        train_run(merge_flags(flags, RESHARD_CHAIN[0], {"save": first, "save-interval": 2}),
                  4, pool)
        saved = read_checkpoint(first)["tensors"]
        kinds = {name.rsplit("/", 1)[-1] for name in saved if name.startswith("optim/")}
        assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds, sorted(kinds)
        load = first
        for hop, layout in enumerate(RESHARD_CHAIN[1:], start=1):
            save = os.path.join(root, str(hop))
            pool.run(_resave, merge_flags(flags, layout, {"load": os.path.join(
                load, iteration_dirname(2)), "save": save}), world_size=4)
            resaved = read_checkpoint(save)
            wrapper = "fsdp2" if layout.get("use-torch-fsdp2") else "ddp"
            assert resaved["plugins"]["data_parallel"]["name"] == wrapper, layout
            assert resaved["iteration"] == 2, layout
            got = resaved["tensors"]
            assert sorted(got) == sorted(saved), layout
            differ = [n for n in saved if not torch.equal(got[n], saved[n])]
            assert not differ, f"{layout_name(layout)}: {differ[:5]}"
            load = save
