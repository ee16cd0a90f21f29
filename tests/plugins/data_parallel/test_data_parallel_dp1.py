"""Data-parallel machinery on one rank: the wrapper and optimizer variants against the plain
run, the token-weighted loss, and the optimizer's sharded state (contract and round trips)."""

import pytest
import torch
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.data import collate
from plugtron.core.training.loop import setup
from plugtron.core.training.optimizer import OPTIMIZER_STATE_KEY

from tests.distributed.dp_helpers import (
    DP_BASE,
    UnevenLossMask,
    bf16_ulps,
    losses,
    main_params,
    max_param_diff,
    max_rel_diff,
    one_thread,
    resume_run,
    state_after,
    train_run,
)
from tests.utils import tiny_config

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

#: fp32, one rank: the variants only change how the same sums are laid out.
TOL = 1e-5

VARIANTS = {
    "overlap": {"overlap_grad_reduce": True},
    "distributed": {"use_distributed_optimizer": True},
    "distributed+overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                            "overlap_param_gather": True},
}


@pytest.fixture(scope="module")
def reference():
    records, params, _ = train_run({}, world=single_process())
    return losses(records), params


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_the_plain_run(reference, variant):
    records, params, _ = train_run(VARIANTS[variant], world=single_process())
    assert max_rel_diff(losses(records), reference[0]) < TOL
    assert max_param_diff(params, reference[1]) < TOL


def _expected_first_loss() -> float:
    """sum(per-token loss x mask) / sum(mask) over the first global batch, by hand."""
    config = tiny_config(**DP_BASE)
    run = setup(config, extra_plugins=[UnevenLossMask()], world=single_process())
    batch = collate([run.datasets[0][i] for i in range(config.training.global_batch_size)])
    with torch.no_grad():
        per_token = run.model_chunks[0](batch["tokens"], batch["position_ids"],
                                        labels=batch["labels"])
    mask = batch["loss_mask"]
    assert 0 < mask.sum() < mask.numel() / 2  # the masks really are uneven
    return float((per_token * mask).sum() / mask.sum())


def test_loss_is_token_weighted_whatever_the_microbatch_split(reference):
    assert abs(reference[0][0] - _expected_first_loss()) < 1e-6
    for micro_batch_size in (1, 4, 8):
        records, params, _ = train_run({"micro_batch_size": micro_batch_size},
                                       world=single_process())
        assert max_rel_diff(losses(records), reference[0]) < TOL, micro_batch_size
        assert max_param_diff(params, reference[1]) < TOL, micro_batch_size


@pytest.mark.parametrize("optimizer", ["adam", "distributed-adam"])
@pytest.mark.parametrize("bf16", [False, True])
def test_sharded_state_holds_every_param_at_its_local_shape(optimizer, bf16):
    state, params, _ = state_after({"optimizer": optimizer, "bf16": bf16}, 2,
                                   single_process())
    assert state[OPTIMIZER_STATE_KEY] == {"step": 2, "loss_scaler": None}
    assert sorted(k for k in state if k != OPTIMIZER_STATE_KEY) == sorted(params)
    keys = {"exp_avg", "exp_avg_sq"} | ({"main_param"} if bf16 else set())
    for name, shaped in params.items():
        assert set(state[name]) == keys, name
        for tensor in state[name].values():
            assert tensor.shape == shaped.shape and tensor.dtype == torch.float32
        if bf16:  # the bf16 model param is the rounded main param
            main = state[name]["main_param"]
            assert torch.equal(main.to(torch.bfloat16).float(), shaped)


def test_fp16_state_carries_the_loss_scaler():
    state, _, _ = state_after({"fp16": True, "initial_loss_scale": 256.0}, 2,
                              single_process())
    scaler = state[OPTIMIZER_STATE_KEY]["loss_scaler"]
    assert scaler["scale"] == 256.0 and scaler["growth_tracker"] == 2


@pytest.mark.parametrize("source, target", [("adam", "distributed-adam"),
                                            ("distributed-adam", "adam")])
@pytest.mark.parametrize("bf16", [False, True])
def test_state_round_trip_between_optimizers(source, target, bf16):
    world, run_length = single_process(), {"train_iters": 4, "bf16": bf16}
    state, params, _ = state_after({**run_length, "optimizer": source}, 3, world)
    resumed, final, final_main = resume_run({**run_length, "optimizer": target}, state, params,
                                            3, world)
    records, expected, run = train_run({**run_length, "optimizer": target}, world)
    assert [r["iteration"] for r in resumed] == [4]
    assert max_rel_diff(losses(resumed), losses(records)[3:]) < TOL
    # The fp32 tolerance holds for what the optimizers compute: their fp32 main params. The
    # bf16 params only round those, and two main params 3e-6 apart (adam and distributed-adam
    # lay out their buffers differently; oneDNN's AVX512-BF16 kernels, without AMX, then sum in
    # another order) can round to neighbouring bf16 values, 3.05e-5 apart near 0.004.
    assert max_param_diff(final_main, main_params(run)) < TOL
    if bf16:
        assert bf16_ulps(final, expected) <= 1
