"""Activation recompute: with dropout on, every mode gives bitwise the losses, grad norms and
final weights of the run without it, and keeps fewer activations for backward."""

from __future__ import annotations

import pytest
import torch
from plugtron.core.errors import ConfigError
from plugtron.core.training.recompute import recompute_plan
from plugtron.core.training.validate import validate
from plugtron.testing import train_run

from tests.utils import tiny_config

DROPOUT = {"num-layers": 4, "hidden-dropout": 0.1, "attention-dropout": 0.1, "train-iters": 3}

MODES = {
    "full uniform 1": {"recompute-granularity": "full"},
    "full uniform 2": {"recompute-granularity": "full", "recompute-num-layers": 2},
    "full block 3": {"recompute-granularity": "full", "recompute-method": "block",
                     "recompute-num-layers": 3},
    "selective core_attn": {"recompute-granularity": "selective"},
    "selective mlp,layernorm": {"recompute-granularity": "selective",
                                "recompute-modules": ["mlp,layernorm"]},
}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(1)  # one worker process for every run of the module


@pytest.fixture(scope="module")
def reference(pool):
    return train_run(DROPOUT, 1, pool, gather_params=True)


def _assert_bitwise(got, want, what):
    for key in ("lm_loss", "grad_norm"):
        assert [r[key] for r in got.records] == [r[key] for r in want.records], (what, key)
    for name, tensor in want.params.items():
        assert torch.equal(got.params[name], tensor), (what, name)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_recompute_is_bitwise_the_run_without_it(reference, pool, mode):
    got = train_run({**DROPOUT, **MODES[mode]}, 1, pool, gather_params=True)
    _assert_bitwise(got, reference, mode)


def test_hybrid_and_rope_layers_recompute_bitwise(pool):
    flags = {"model": "hybrid", "hybrid-layer-pattern": "M*-M-", "mamba-state-dim": 8,
             "mamba-head-dim": 8, "mamba-num-groups": 2, "hidden-dropout": 0.1,
             "attention-dropout": 0.1, "position-embedding-type": "rope", "train-iters": 2}
    want = train_run(flags, 1, pool, gather_params=True)
    got = train_run({**flags, "recompute-granularity": "full", "recompute-num-layers": 2}, 1,
                    pool, gather_params=True)
    _assert_bitwise(got, want, "hybrid full")


def _saved_bytes(config) -> int:
    """Bytes autograd keeps for backward over one forward of the model."""
    from plugtron.core.training.loop import setup

    run = setup(config)
    model = run.model_chunks[0]
    model.train()
    tokens = torch.randint(0, config.model.vocab_size, (2, config.model.seq_length))
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens).sum().backward()
    return total[0]


def test_recompute_keeps_fewer_activations():
    base = dict(num_layers=4, seq_length=32, max_position_embeddings=32, hidden_size=32)
    none = _saved_bytes(tiny_config(**base))
    full = _saved_bytes(tiny_config(**base, recompute_granularity="full"))
    selective = _saved_bytes(tiny_config(**base, recompute_granularity="selective"))
    # The counting hook sees the recomputed forward's saves too (inside backward, freed per
    # layer), so these are upper bounds of what is alive at once; full keeps the least.
    assert full < selective < none, (full, selective, none)


def test_plan_of_each_method():
    assert recompute_plan(tiny_config(), 4) == [(0, 4, False)]
    full = tiny_config(recompute_granularity="full", recompute_num_layers=3)
    assert recompute_plan(full, 4) == [(0, 3, True), (3, 4, True)]
    block = tiny_config(recompute_granularity="full", recompute_method="block",
                        recompute_num_layers=3)
    assert recompute_plan(block, 4) == [(0, 1, True), (1, 2, True), (2, 3, True),
                                        (3, 4, False)]
    assert recompute_plan(block, 2) == [(0, 1, True), (1, 2, True)]


@pytest.mark.parametrize("flags, message", [
    ({"recompute_modules": ["core_attn"]}, "needs --recompute-granularity selective"),
    ({"recompute_granularity": "selective", "recompute_modules": ["attn"]}, "unknown; allowed"),
    ({"recompute_num_layers": 2}, "need --recompute-granularity full"),
    ({"recompute_granularity": "full", "recompute_num_layers": 0}, "at least 1"),
    ({"recompute_granularity": "selective", "recompute_method": "block"}, "full only"),
])
def test_bad_recompute_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**flags), 1)
