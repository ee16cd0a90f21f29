"""The router against Megatron-Core's own code (skipped when megatron-core is not installed):
on the same random logits, plugtron's routing arithmetic and TopKRouter give Megatron-Core's
probabilities, routing map, every balancing and z loss, their gradients, capacity and padding,
and expert-bias updates, within 1e-6 relative (maps exactly).

Megatron's router works on ``[s, b]`` rows, plugtron's on ``[b, s]``: the comparisons feed
Megatron the same tokens sequence-major and compare after reordering. Megatron's
``TopKRouter.routing`` runs on CPU here with stand-in groups of size one (its collectives are
then identities) and its torch.compile'd expert-bias counting run uncompiled. ``position`` dropping is compared with Megatron's
``apply_router_token_dropping`` run with a top-k that breaks ties towards the earlier row, the
order Megatron documents (its plain ``torch.topk`` over a 0/1 map leaves ties unspecified).
"""

from __future__ import annotations

import contextlib
import json
import os
import types

import pytest
import torch
from plugtron.api import ParallelContext
from plugtron_moe import routing
from plugtron_moe.router import TopKRouter

from tests.utils import tiny_config

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe import moe_utils as mu  # noqa: E402
from megatron.core.transformer.moe import router as megatron_router  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

RTOL = 1e-6
E = 8
#: The largest relative difference seen per compared quantity; written as JSON to the file
#: $PLUGTRON_PARITY_FIGURES names, when set (the figures of docs/moe.md).
FIGURES: dict[str, float] = {}


@pytest.fixture(autouse=True, scope="module")
def _write_figures():
    yield
    path = os.environ.get("PLUGTRON_PARITY_FIGURES")
    if path:
        with open(path, "w") as out:
            json.dump(FIGURES, out, indent=1, sort_keys=True)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (0 when both are zero)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale else diff


def close(got, want, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = rel(got, want)
    FIGURES[what] = max(FIGURES.get(what, 0.0), diff)
    assert diff <= RTOL, (what, diff)


# ---------------------------------------------------------------- moe_utils, function by function

ROUTINGS = [
    ("softmax", {}), ("softmax-pre", {"use_pre_softmax": True}), ("sigmoid", {}),
    ("sqrtsoftplus", {}), ("sigmoid-bias", {"expert_bias": True}),
    ("sqrtsoftplus-bias", {"expert_bias": True}),
    ("groups", {"num_groups": 4, "group_topk": 2}),
    ("sigmoid-groups-scaled", {"num_groups": 4, "group_topk": 2, "scaling_factor": 2.5}),
    ("softmax-pre-scaled", {"use_pre_softmax": True, "scaling_factor": 1.7}),
]


@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("name,kwargs", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_topk_routing_forward_and_backward(name, kwargs, topk):
    if "groups" in name and topk % kwargs["group_topk"]:
        pytest.skip("group-limited top-k needs topk divisible by group_topk")
    torch.manual_seed(topk)
    score = name.split("-")[0] if not name.startswith("groups") else "softmax"
    mkw = dict(kwargs, score_function=score)
    if mkw.pop("expert_bias", False):
        mkw["expert_bias"] = torch.randn(E) * 0.1
    logits = torch.randn(24, E, dtype=torch.float32)
    weights = torch.randn(24, E)
    ours = dict(mkw)
    if "use_pre_softmax" in ours:
        ours["pre_softmax"] = ours.pop("use_pre_softmax")

    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = mu.topk_routing_with_score_function(a, topk, **mkw)
    got = routing.topk_routing(b, topk, **ours)
    assert torch.equal(got[1], want[1])
    close(got[0], want[0], "probs")
    (want[0] * weights).sum().backward()
    (got[0] * weights).sum().backward()
    close(b.grad, a.grad, "d probs / d logits")


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_scores_for_the_balancing_loss(score):
    torch.manual_seed(5)
    logits = torch.randn(24, E)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want_map, want = mu.compute_routing_scores_for_aux_loss(a, 2, score)
    got_map, got = routing.scores_for_aux_loss(b, 2, score)
    assert torch.equal(got_map, want_map)
    close(got, want, "scores")
    weights = torch.randn(24, E)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    close(b.grad, a.grad, "d scores / d logits")


def test_switch_and_z_loss_values_and_gradients():
    torch.manual_seed(6)
    logits = torch.randn(24, E)
    probs = torch.softmax(logits, -1)
    counts = torch.randint(0, 12, (E,)).float()
    for total, topk, coeff in ((24, 2, 1e-2), (48, 4, 0.3), (24, 1, 1.0)):
        a, b = probs.clone().requires_grad_(), probs.clone().requires_grad_()
        want = mu.switch_load_balancing_loss_func(a, counts, total, topk, E, coeff)
        got = routing.switch_load_balancing_loss(b, counts, total, topk, E, coeff)
        close(got, want, "switch loss")
        want.backward()
        got.backward()
        close(b.grad, a.grad, "d switch loss / d probs")
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want, got = mu.z_loss_func(a, 1e-3), routing.z_loss(b, 1e-3)
    close(got, want, "z loss")
    want.backward()
    got.backward()
    close(b.grad, a.grad, "d z loss / d logits")


def test_capacity():
    for tokens in (1, 7, 24, 96, 1000, 4097):
        for experts in (1, 3, 8, 64):
            for factor in (0.25, 0.5, 1.0, 1.3, 2.0):
                assert routing.capacity(tokens, experts, factor) == mu.get_capacity(
                    tokens, experts, factor)


class _StableTopkTorch(types.ModuleType):
    """A stand-in for the ``torch`` module inside moe_utils whose ``topk`` breaks ties towards
    the earlier row (a stable descending sort); everything else is torch's own."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def topk(x, k, dim=-1, sorted=True):  # noqa: A002 - torch's keyword
        order = torch.sort(x, dim=dim, descending=True, stable=True)
        return order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)


def _stable_topk_torch():
    return _StableTopkTorch("torch")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_token_dropping_and_padding(batch, policy, pad, factor, monkeypatch):
    torch.manual_seed(7)
    seq = 8
    logits = torch.randn(batch * seq, E)  # plugtron's rows: [b, s]
    probs, routing_map = routing.topk_routing(logits, 2)
    sm_probs = routing.sequence_major(probs, batch)
    sm_map = routing.sequence_major(routing_map, batch)
    if policy == "position":
        monkeypatch.setattr(mu, "torch", _stable_topk_torch())
    want = mu.apply_router_token_dropping(sm_probs, sm_map, 2, factor, policy, pad)
    monkeypatch.undo()
    got = routing.apply_token_dropping(probs, routing_map, 2, factor, policy, pad,
                                       batch_size=batch)
    assert torch.equal(routing.sequence_major(got[1], batch), want[1])
    close(routing.sequence_major(got[0], batch), want[0], "dropped probs")


def test_sinkhorn_values():
    for seed in range(4):
        torch.manual_seed(seed)
        cost = torch.randn(32, E) * (seed + 1)
        close(routing.sinkhorn(cost), mu.sinkhorn(cost), "sinkhorn")


def test_expert_bias_update(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    torch.manual_seed(8)
    counts = torch.randint(0, 40, (E,)).float()
    counts[3] = counts.mean()  # on the mean: no move
    bias = torch.randn(E)
    want = mu.get_updated_expert_bias(counts.clone(), bias, 1e-3, tp_dp_cp_group=object())
    close(routing.updated_expert_bias(counts.clone(), bias, 1e-3), want, "expert bias")


# ---------------------------------------------------------------- the whole router

class _GroupOfOne:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@contextlib.contextmanager
def _megatron_cpu(monkeypatch):
    """What Megatron's TopKRouter needs to run on CPU in one process: stand-in groups of one
    (its tp reductions are then identities), buffers on the CPU."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.distributed, "is_initialized", lambda: True)
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        yield


def _megatron_router(flags: dict, monkeypatch):
    one = _GroupOfOne()
    groups = types.SimpleNamespace(tp=one, cp=one, tp_cp=one, tp_dp_cp=one)
    kwargs = {k: v for k, v in flags.items() if k != "num_experts"}
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               num_moe_experts=flags["num_experts"],
                               use_cpu_initialization=True, **kwargs)
    with _megatron_cpu(monkeypatch):
        router = megatron_router.TopKRouter(config, pg_collection=groups)
    router.set_layer_number(1)
    # its expert-bias counting is torch.compile'd: run the plain function on CPU
    monkeypatch.setattr(megatron_router.TopKRouter, "_apply_expert_bias",
                        megatron_router.TopKRouter._apply_expert_bias.__wrapped__)
    losses: dict[str, torch.Tensor] = {}
    attach = router.attach_and_log_load_balancing_loss

    def capture(activation, coeff, aux_loss, name, *args, **kwargs):
        losses[name] = aux_loss
        return attach(activation, coeff, aux_loss, name, *args, **kwargs)

    router.attach_and_log_load_balancing_loss = capture
    z_loss = megatron_router.z_loss_func

    def capture_z(logits, coeff, padding_mask=None):
        losses["z_loss"] = z_loss(logits, coeff, padding_mask=padding_mask)
        return losses["z_loss"]

    monkeypatch.setattr(megatron_router, "z_loss_func", capture_z)
    return router, losses


ROUTERS = {
    "softmax aux_loss z": {"moe_router_load_balancing_type": "aux_loss",
                           "moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3},
    "pre-softmax top-1 seq_aux_loss": {"moe_router_topk": 1, "moe_router_pre_softmax": True,
                                       "moe_router_load_balancing_type": "seq_aux_loss",
                                       "moe_aux_loss_coeff": 1e-2},
    "sigmoid bias global_aux_loss": {"moe_router_score_function": "sigmoid",
                                     "moe_router_enable_expert_bias": True,
                                     "moe_router_load_balancing_type": "global_aux_loss",
                                     "moe_aux_loss_coeff": 1e-2},
    "sqrtsoftplus bias, three losses": {
        "moe_router_score_function": "sqrtsoftplus", "moe_router_enable_expert_bias": True,
        "moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss", "global_aux_loss"],
        "moe_aux_loss_coeff": [1e-2, 1e-3, 1e-1], "moe_z_loss_coeff": 1e-3},
    "groups scaled, two losses": {
        "moe_router_score_function": "sigmoid", "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5,
        "moe_router_load_balancing_type": ["seq_aux_loss", "aux_loss"],
        "moe_aux_loss_coeff": [1e-3, 1e-2]},
    "capacity probs padded": {"moe_expert_capacity_factor": 0.75,
                              "moe_pad_expert_input_to_capacity": True,
                              "moe_aux_loss_coeff": 1e-2},
    "capacity probs": {"moe_expert_capacity_factor": 0.5, "moe_aux_loss_coeff": 1e-2},
    "sinkhorn top-2": {"moe_router_load_balancing_type": "sinkhorn", "moe_z_loss_coeff": 1e-3},
    "sinkhorn top-1": {"moe_router_load_balancing_type": "sinkhorn", "moe_router_topk": 1},
}


@pytest.mark.parametrize("case", list(ROUTERS))
def test_router_equals_megatron_core(case, monkeypatch):
    flags = {"num_experts": E, "moe_router_topk": 2, **ROUTERS[case]}
    batch, seq = 3, 8
    torch.manual_seed(11)
    ours = TopKRouter(tiny_config(**flags), ParallelContext.build(1, 0), "r", 0, 1)
    theirs, their_losses = _megatron_router(flags, monkeypatch)
    if ours.expert_bias is not None:
        ours.expert_bias.copy_(torch.randn(E) * 0.05)
        theirs.expert_bias.copy_(ours.expert_bias)
    mu.MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    their_weight = ours.weight.detach().clone().requires_grad_()
    hidden = ours.weight.shape[1]
    for step in range(2):  # two microbatches: global_aux_loss accumulates its counts
        x = torch.randn(batch * seq, hidden)  # plugtron's rows, [b, s]
        ours.weight.grad = their_weight.grad = None
        ours._seq_shape = (seq, batch)
        probs, routing_map, aux = ours(x)
        our_losses = dict(aux)

        with _megatron_cpu(monkeypatch):
            logits = torch.nn.functional.linear(routing.sequence_major(x, batch), their_weight)
            their_probs, their_map = theirs.routing(logits.view(seq, batch, E))
        assert torch.equal(routing.sequence_major(routing_map, batch), their_map)
        close(routing.sequence_major(probs, batch), their_probs, "probs")

        # the losses: one type is reported as load_balancing_loss, several under Megatron's
        # names; z_loss by its name
        assert len(our_losses) == len(their_losses)
        for name, loss in their_losses.items():
            mine = our_losses[name] if name in our_losses else our_losses["load_balancing_loss"]
            close(mine, loss, name)
        their_losses.clear()

        # gradients: Megatron attaches its losses to probs/logits; plugtron adds them
        weights = torch.randn(batch * seq, E)
        (their_probs * routing.sequence_major(weights, batch)).sum().backward()
        ((probs * weights).sum() + sum(our_losses.values(), torch.zeros(()))).backward()
        close(ours.weight.grad, their_weight.grad, "d (probs . w + losses) / d router weight")

    if ours.expert_bias is not None:  # the counts behind the bias update
        close(ours.local_tokens_per_expert, theirs.local_tokens_per_expert, "tokens per expert")


def test_position_dropping_in_the_router_equals_megatron_with_ordered_ties(monkeypatch):
    flags = {"num_experts": E, "moe_router_topk": 2, "moe_expert_capacity_factor": 0.5,
             "moe_token_drop_policy": "position", "moe_pad_expert_input_to_capacity": True}
    batch, seq = 4, 6
    torch.manual_seed(12)
    ours = TopKRouter(tiny_config(**flags), ParallelContext.build(1, 0), "r", 0, 1)
    theirs, _ = _megatron_router(flags, monkeypatch)
    x = torch.randn(batch * seq, ours.weight.shape[1])
    ours._seq_shape = (seq, batch)
    probs, routing_map, _ = ours(x)
    monkeypatch.setattr(mu, "torch", _stable_topk_torch())
    with _megatron_cpu(monkeypatch):
        logits = torch.nn.functional.linear(routing.sequence_major(x, batch), ours.weight)
        their_probs, their_map = theirs.routing(logits.view(seq, batch, E))
    assert torch.equal(routing.sequence_major(routing_map, batch), their_map)
    close(routing.sequence_major(probs, batch), their_probs, "probs")
