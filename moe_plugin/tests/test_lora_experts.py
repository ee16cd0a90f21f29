"""LoRA on the routed experts' linears (each expert its own adapters, expert parameters) at
ep 2 x dp 2, with the all-to-all and the all-gather dispatcher, trains like one process:
losses and grad norms relative 1e-5 over 3 iterations, and the trained adapters, attention's
and every expert's, within 1e-5 of one process's (gathered by global name). fp32, dropout 0.
One pool of 2 ranks. Saved at ep 2, every expert's adapters load in one process bit for bit."""

from __future__ import annotations

import pytest
import torch
from plugtron.testing import assert_records_close, train_run

from tests.distributed.dp_helpers import max_param_diff

FLAGS = {"model": "gpt", "num-layers": 2, "num-experts": 4, "moe-router-topk": 2,
         "moe-ffn-hidden-size": 16, "swiglu": True, "lora-rank": 4, "lora-alpha": 8.0,
         "train-iters": 3}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_adapters_at_ep_2_train_like_one_process(pool, dispatcher):
    flags = {**FLAGS, "moe-token-dispatcher-type": dispatcher}
    one = train_run(flags, 1, pool, gather_params=True)
    split = train_run({**flags, "expert-model-parallel-size": 2, "dp": 2}, 2, pool,
                      gather_params=True)
    assert_records_close(split.records, one.records, 1e-5, f"ep 2 ({dispatcher})")
    assert one.params is not None and split.params is not None
    adapters = {n for n in one.params if ".adapter." in n}
    experts = {n for n in adapters if ".local_experts." in n}
    assert len(experts) == 2 * 4 * 2 * 2  # 2 layers x 4 experts x (fc1, fc2) x (A, B)
    trained_b = [one.params[n] for n in experts if n.endswith("linear_out.weight")]
    assert all(b.abs().max() > 0 for b in trained_b)  # every expert's adapter trained
    assert max_param_diff({n: split.params[n] for n in adapters},
                          {n: one.params[n] for n in adapters}) < 1e-5


def test_expert_adapters_saved_at_ep_2_load_in_one_process(pool, tmp_path):
    """The checkpoint holds every expert's adapters by global name: ``load_model`` in one
    process reads what the two ep ranks trained, bit for bit."""
    from plugtron.api import load_model

    save = str(tmp_path / "ckpt")
    split = train_run({**FLAGS, "expert-model-parallel-size": 2, "dp": 2, "save": save}, 2,
                      pool, gather_params=True)
    assert split.params is not None
    loaded = dict(load_model(save).module.named_parameters())
    experts = [n for n in split.params if ".local_experts." in n and ".adapter." in n]
    assert len(experts) == 32
    assert all(torch.equal(loaded[n], split.params[n]) for n in experts)
