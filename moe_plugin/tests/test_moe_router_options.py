"""Router options not covered by the arithmetic tests: the seq and global aux-loss kinds
(against Megatron-Core's definitions, recomputed here by hand), the router dtype, input
jitter, and the expert RNG stream inside the experts. One process, no training."""

from __future__ import annotations

import contextlib

import pytest
import torch
from plugtron.api import EXPERT_PARALLEL_RNG, ParallelContext
from plugtron_moe.experts import SequentialMLP
from plugtron_moe.router import TopKRouter

from tests.utils import tiny_config

E, K, COEFF = 4, 2, 0.1


def _router(**flags):
    config = tiny_config(num_experts=E, moe_router_topk=K, moe_aux_loss_coeff=COEFF, **flags)
    return TopKRouter(config, ParallelContext.build(1, 0), "r", 0, 1), config


def _switch(x, weight):
    """Megatron's switch loss on tokens ``x`` alone: coeff E/(k T^2) sum_i P_i c_i, with c_i the
    tokens whose softmax top-k holds i."""
    scores = torch.softmax(x @ weight.t(), dim=-1)
    counts = torch.zeros(E).index_add_(0, scores.topk(K, dim=-1).indices.flatten(),
                                       torch.ones(x.shape[0] * K))
    return COEFF * E / (K * x.shape[0] ** 2) * (scores.sum(0) * counts).sum()


def test_seq_aux_loss_is_the_mean_over_sequences_of_the_per_sequence_loss():
    router, _ = _router(moe_router_load_balancing_type="seq_aux_loss")
    batch, seq = 3, 5
    x = torch.randn(batch, seq, 32)
    router._seq_shape = (seq, batch)  # the layer sets it from its [b, s, h] input
    _, _, aux = router(x.reshape(-1, 32))
    want = sum(_switch(x[b], router.weight) for b in range(batch)) / batch
    torch.testing.assert_close(dict(aux)["load_balancing_loss"], want)


def test_global_aux_loss_uses_the_counts_averaged_over_the_global_batch():
    router, _ = _router(moe_router_load_balancing_type="global_aux_loss")
    xs = [torch.randn(6, 32) for _ in range(3)]
    w = router.weight.detach()

    def counts(x):
        top = torch.softmax(x @ w.t(), -1).topk(K, dim=-1).indices.flatten()
        return torch.zeros(E).index_add_(0, top, torch.ones(x.shape[0] * K))

    def loss(x, c):  # the switch loss of x's probabilities with the counts c
        return COEFF * E / (K * x.shape[0] ** 2) * (torch.softmax(x @ w.t(), -1).sum(0) * c).sum()

    got = [dict(router(x)[2])["load_balancing_loss"] for x in xs[:2]]
    torch.testing.assert_close(got[0], loss(xs[0], counts(xs[0])))
    torch.testing.assert_close(got[1], loss(xs[1], (counts(xs[0]) + counts(xs[1])) / 2))
    router.reset_global_aux_loss()  # after the step: a new global batch
    torch.testing.assert_close(dict(router(xs[2])[2])["load_balancing_loss"],
                               loss(xs[2], counts(xs[2])))


@pytest.mark.parametrize("dtype,want", [("fp64", torch.float64), ("fp32", torch.float32)])
def test_router_dtype_sets_the_gating_precision(dtype, want):
    router, _ = _router(moe_router_dtype=dtype)
    assert router.gating(torch.randn(2, 32)).dtype == want


def test_input_jitter_only_in_training():
    router, _ = _router(moe_input_jitter_eps=0.1)
    x = torch.randn(50, 32)
    jittered = router.jitter(x)
    ratio = jittered / x
    assert not torch.equal(jittered, x) and ratio.min() >= 0.9 - 1e-6 and ratio.max() <= 1.1 + 1e-6
    router.eval()
    assert torch.equal(router.jitter(x), x)


def test_experts_compute_under_the_expert_rng_stream():
    config = tiny_config(num_experts=E, moe_router_topk=K)
    experts = SequentialMLP(config, ParallelContext.build(1, 0), "x", 0, list(range(E)))
    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self, name):
            forks.append(name)
            yield

    experts.rng_tracker = Tracker()
    experts(torch.randn(8, 32), [2, 2, 2, 2])
    assert forks == [EXPERT_PARALLEL_RNG]


def test_position_drop_in_the_router_keeps_the_earliest_positions_of_every_sequence():
    # b > 1: the router ranks its [b, s] rows sequence-major, as Megatron's [s, b] rows.
    router, _ = _router(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")
    batch, seq = 3, 8
    x = torch.randn(batch, seq, 32)
    router._seq_shape = (seq, batch)  # the layer sets it from its [b, s, h] input
    _, kept, _ = router(x.reshape(-1, 32))
    chosen = torch.softmax(x.reshape(-1, 32) @ router.weight.detach().t(), -1).topk(K).indices
    routed = torch.zeros(batch * seq, E, dtype=torch.bool).scatter(1, chosen, True)
    cap = -(-batch * seq * K * 0.5 // E)  # ceil(tokens x k / E x factor)
    in_order = routed.reshape(batch, seq, E).transpose(0, 1)  # [s, b, E]: Megatron's order
    rank = in_order.reshape(-1, E).long().cumsum(0).reshape(seq, batch, E)
    want = (in_order & (rank <= cap)).transpose(0, 1).reshape(-1, E)
    assert torch.equal(kept, want)
    assert (kept.reshape(batch, seq, E)[:, 0] == routed.reshape(batch, seq, E)[:, 0]).all()


def test_the_layer_hands_the_router_its_sequences(monkeypatch):
    # In a real step the layer's [b, s, h] input reaches the capacity ranking with its b.
    from plugtron_moe import routing

    from tests.utils import train_in_process

    seen = []
    drop = routing.apply_token_dropping

    def spy(probs, routing_map, *args, batch_size=1, **kwargs):
        seen.append((probs.shape[0], batch_size))
        return drop(probs, routing_map, *args, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(routing, "apply_token_dropping", spy)
    config = tiny_config(num_experts=E, moe_router_topk=K, train_iters=1,
                         moe_expert_capacity_factor=0.5, moe_token_drop_policy="position",
                         moe_pad_expert_input_to_capacity=True)
    records, _ = train_in_process(config)
    assert records and seen
    micro_batch, seq = config.training.micro_batch_size, config.model.seq_length
    assert micro_batch > 1 and set(seen) == {(micro_batch * seq, micro_batch)}
