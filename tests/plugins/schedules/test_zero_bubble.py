"""The split backward (``I`` / ``W``) without ranks: the plan check, the simulator, ``schedule
show``, and the deferred weight gradients of the local linears against the combined backward."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.vocab_parallel import VocabParallelEmbedding, parallel_logits
from plugtron.core.pipeline.plan import Action, check_actions, idle_in_span, peak_stored, simulate
from plugtron.plugins.schedules.one_f_one_b import one_f_one_b_actions
from plugtron.plugins.schedules.zero_bubble import zb_h1_actions


def _split(actions):
    out = []
    for a in actions:
        out += [Action("I", a.microbatch), Action("W", a.microbatch)] if a.kind == "B" else [a]
    return out


def test_a_w_before_its_i_is_rejected():
    actions = [Action("F", 0), Action("W", 0), Action("I", 0)]
    with pytest.raises(ConfigError, match="W0 runs before its I"):
        check_actions([actions], 1, 1)


def test_leftover_ws_are_rejected():
    actions = [Action("F", 0), Action("F", 1), Action("I", 0), Action("I", 1), Action("W", 0)]
    with pytest.raises(ConfigError, match="left over at the end: no W1 after their I"):
        check_actions([actions], 1, 2)


def test_an_i_and_a_b_of_one_microbatch_are_rejected():
    actions = [Action("F", 0), Action("I", 0), Action("B", 0), Action("W", 0)]
    with pytest.raises(ConfigError, match="backward exactly once"):
        check_actions([actions], 1, 1)


def test_an_i_before_its_forward_is_rejected():
    with pytest.raises(ConfigError, match="I0 runs before its forward"):
        check_actions([[Action("I", 0), Action("F", 0), Action("W", 0)]], 1, 1)


def test_a_w_may_run_long_after_its_i_and_ws_wait_for_nobody():
    # 1F1B with every W at the very end: valid, and the simulator finishes it.
    per_rank = []
    for rank in range(4):
        order = [a if a.kind == "F" else Action("I", a.microbatch)
                 for a in one_f_one_b_actions(rank, 4, 6)]
        per_rank.append(order + [Action("W", mb) for mb in range(6)])
    check_actions(per_rank, 1, 6)
    simulate(per_rank, 1, 1.0, 2.0, 1.0, 1.0)
    assert peak_stored(per_rank[0]) == 6  # a microbatch is held until its W


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0),
                                   (1.0, 1.0, 0.5)])
def test_zb_h1_bubble_is_the_papers(costs):
    # The paper's ZB-H1 (p - 1)(T_F + T_B - T_W) (T_B: the input gradient, W <= I) against
    # 1F1B's (p - 1)(T_F + T_B + T_W): makespan over the work, and idle inside rank 0's span.
    f, i, w = costs
    for pp, m in [(2, 4), (4, 8), (4, 12), (3, 7)]:
        zb = simulate([zb_h1_actions(r, pp, m) for r in range(pp)], 1, f, i + w, i, w)
        ref = simulate([one_f_one_b_actions(r, pp, m) for r in range(pp)], 1, f, i + w)
        assert max(s.end for r in zb for s in r) == m * (f + i + w) + (pp - 1) * (f + i - w)
        assert max(s.end for r in ref for s in r) == m * (f + i + w) + (pp - 1) * (f + i + w)
        assert idle_in_span(zb)[0] == (pp - 1) * (f + i - w)
        assert idle_in_span(ref)[0] == (pp - 1) * (f + i + w)
        # every rank holds what 1F1B's first rank holds
        assert ([peak_stored(zb_h1_actions(r, pp, m)) for r in range(pp)]
                == [peak_stored(one_f_one_b_actions(0, pp, m))] * pp)


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0),
                                   (2.0, 1.0, 1.0), (1.0, 1.0, 0.5)])
def test_zb_h2_bubble_and_memory_are_the_papers(costs):
    # ZB-H2: idle inside each rank's span (p - 1)(T_F + T_B - 2 T_W), zero for equal costs,
    # within the paper's memory limit of 2p - 1 microbatches
    from plugtron.plugins.schedules.zero_bubble_h2 import zb_h2_actions

    f, i, w = costs
    for pp, m in [(2, 4), (4, 8), (4, 12), (3, 7), (5, 9)]:
        lists = [zb_h2_actions(r, pp, m) for r in range(pp)]
        check_actions(lists, 1, m)
        slots = simulate(lists, 1, f, i + w, i, w)
        assert idle_in_span(slots)[0] == (pp - 1) * (f + i - 2 * w)
        assert [peak_stored(a) for a in lists] == [2 * pp - 1] * pp
    for pp in (2, 3, 4, 8):  # fewer microbatches: still valid, never over the limit
        for m in range(1, 2 * pp - 1):
            lists = [zb_h2_actions(r, pp, m) for r in range(pp)]
            check_actions(lists, 1, m)
            simulate(lists, 1, 1.0, 2.0, 1.0, 1.0)
            assert max(peak_stored(a) for a in lists) <= 2 * pp - 1


def test_zb_h1_is_1f1b_with_each_b_split_and_rank_r_deferring_r_weights():
    for pp, m in [(2, 4), (4, 3), (4, 8)]:
        for rank in range(pp):
            order = zb_h1_actions(rank, pp, m)
            assert [a for a in order if a.kind != "W"] == [
                a for a in _split(one_f_one_b_actions(rank, pp, m)) if a.kind != "W"]
            inputs = [a.microbatch for a in order if a.kind in "IW"]
            # the W of microbatch k follows the I of microbatch k + rank (or the last I)
            for k in range(m):
                after = inputs.index(min(k + rank, m - 1))
                assert k in inputs[after + 1:]


def test_schedule_show_prints_zb_h1():
    out = CliRunner().invoke(cli, ["schedule", "show", "--schedule", "zb-h1", "--pp", "4",
                                   "-m", "8"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "schedule zb-h1: pp 4, 8 microbatches"
    assert lines[1] == ("rank 0: F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 "
                        "I6 W6 I7 W7")
    assert "bubble fraction 0.1111 (forward 1, backward 2 per chunk; makespan 27)" in out.output
    assert "split backward: I (input gradient) 1, W (weight gradients) 1" in out.output
    assert ("idle inside each rank's own span (the paper's bubble, iterations back to back): "
            "3 2 1 0; bubble rate 0.1250") in out.output  # (p - 1) / 3m
    assert "peak stored activations (microbatch-chunks) per rank: 4 4 4 4" in out.output


def test_schedule_show_json_and_costs(tmp_path):
    out = CliRunner().invoke(cli, ["schedule", "show", "--schedule", "zb-h1", "--pp", "2",
                                   "-m", "4", "--costs", "1,2,1", "--json",
                                   "--plot", str(tmp_path / "t.png")])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["costs"] == {"F": 1.0, "I": 2.0, "W": 1.0, "B": 3.0}
    assert report["ranks"][1]["actions"][:4] == [{"kind": "F", "microbatch": 0, "chunk": 0},
                                                 {"kind": "I", "microbatch": 0, "chunk": 0},
                                                 {"kind": "F", "microbatch": 1, "chunk": 0},
                                                 {"kind": "I", "microbatch": 1, "chunk": 0}]
    # (P - 1)(F + I - W) = 2 idle of a makespan 4 x 4 + 2
    assert report["makespan"] == 18.0
    assert report["ranks"][0]["idle_in_span"] == 2.0
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(cli, ["schedule", "show", "--schedule", "zb-h1", "--pp", "2",
                                   "-m", "4", "--costs", "1,2"])
    assert bad.exit_code != 0 and "--costs takes three positive numbers" in bad.output


def _grads(fn, params, x, grad_out, split):
    """Run ``fn`` forward and backward twice (two microbatches accumulating) either combined or
    as I then (after both I's) W; return the input and parameter gradients."""
    for p in params:
        p.grad = None
    input_grads = []
    stores = []
    for mb in range(2):
        xi = x[mb].clone().requires_grad_(True)
        with wgrad.expecting_split_backward() if split else _null():
            out = fn(xi)
        if split:
            store = wgrad.WeightGradStore()
            with wgrad.collecting_weight_grads(store):
                out.backward(grad_out[mb])
            stores.append(store)
        else:
            out.backward(grad_out[mb])
        input_grads.append(xi.grad)
    for store in stores:
        assert len(store) > 0  # the weight gradients really waited
        store.run()
    return input_grads, [p.grad.clone() for p in params]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("layer", ["column", "row", "logits"])
def test_deferred_linears_equal_the_combined_backward(layer):
    from plugtron.api import ParallelContext  # noqa: F401 - only to make sure it imports
    from plugtron.plugins.layer_backends.local import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)

    class _Single:
        tp_group, tp_rank, tp_size = None, 0, 1

    def init(shape):
        return torch.randn(shape)

    if layer == "column":
        module = ColumnParallelLinear(8, 6, bias=True, init_method=init, parallel=_Single())
        params = [module.weight, module.bias]

        def fn(x):
            return module(x)[0]
    elif layer == "row":
        module = RowParallelLinear(8, 6, bias=True, init_method=init, parallel=_Single())
        params = [module.weight, module.bias]

        def fn(x):
            return module(x)[0]
    else:
        weight = torch.nn.Parameter(torch.randn(6, 8))
        params = [weight]

        def fn(x):
            return parallel_logits(x, weight, None, False)
    x = torch.randn(2, 3, 5, 8)
    grad_out = torch.randn(2, 3, 5, 6)
    want_inputs, want = _grads(fn, params, x, grad_out, split=False)
    got_inputs, got = _grads(fn, params, x, grad_out, split=True)
    for g, w in zip(got_inputs + got, want_inputs + want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_deferred_norms_equal_the_combined_backward(norm):
    from plugtron.plugins.layer_backends.local import LayerNorm, RMSNorm

    torch.manual_seed(0)
    module = LayerNorm(8, eps=1e-5) if norm == "LayerNorm" else RMSNorm(8, 1e-5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p))
    params = list(module.parameters())
    x, grad_out = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    want_inputs, want = _grads(module, params, x, grad_out, split=False)
    got_inputs, got = _grads(module, params, x, grad_out, split=True)
    for g, w in zip(got_inputs + got, want_inputs + want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_grouped_experts_defer_through_their_stacked_weights():
    # the experts' weights are stacked in the forward; W backpropagates through the stack
    from plugtron.api import batched_linear

    torch.manual_seed(0)
    experts = [torch.nn.Parameter(torch.randn(6, 8)) for _ in range(3)]

    def fn(x):
        return batched_linear(x, torch.stack(experts))

    x, grad_out = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 6)
    want_inputs, want = _grads(fn, experts, x, grad_out, split=False)
    got_inputs, got = _grads(fn, experts, x, grad_out, split=True)
    for g, w in zip(got_inputs + got, want_inputs + want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_grouped_mm_experts_defer_through_their_stacked_weights():
    """Torch's grouped mm (the experts' tokens in groups of 3, 0 and 5 rows): the split
    backward keeps that kernel (no padded batch) and its weight gradient waits for W."""
    from plugtron.api import grouped_linear
    from plugtron_moe.experts import grouped_mm_runs

    if not grouped_mm_runs(torch.device("cpu"), torch.float32):
        pytest.skip("torch's grouped mm does not run here")
    torch.manual_seed(0)
    experts = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(3)]
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)

    def fn(x):
        return grouped_linear(x, torch.stack(experts), offs)

    x, grad_out = torch.randn(2, 8, 8), torch.randn(2, 8, 16)
    want_inputs, want = _grads(fn, experts, x, grad_out, split=False)
    got_inputs, got = _grads(fn, experts, x, grad_out, split=True)
    for g, w in zip(got_inputs + got, want_inputs + want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["conv", "gated_norm"])
def test_mamba_conv_and_gated_norm_defer_exactly(op):
    pytest.importorskip("plugtron_gpt")
    from plugtron_gpt.hybrid.causal_conv import causal_conv_silu
    from plugtron_gpt.hybrid.gated_norm import gated_rms_norm

    torch.manual_seed(0)
    if op == "conv":
        weight, bias = torch.nn.Parameter(torch.randn(8, 1, 4)), torch.nn.Parameter(
            torch.randn(8))
        params = [weight, bias]

        def fn(x):
            return causal_conv_silu(x, weight, bias)
    else:
        weight = torch.nn.Parameter(torch.randn(8))
        params = [weight]
        gate = torch.randn(3, 5, 8)

        def fn(x):
            return gated_rms_norm(x, gate, weight, 4, 1e-5)
    x, grad_out = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    want_inputs, want = _grads(fn, params, x, grad_out, split=False)
    got_inputs, got = _grads(fn, params, x, grad_out, split=True)
    for g, w in zip(got_inputs + got, want_inputs + want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_a_layer_that_cannot_split_is_named():
    class _Opaque(torch.nn.Module):
        weight_grads_at_input = "its kernel computes both gradients at once"

    found = wgrad.weight_grads_at_input([_Opaque(), torch.nn.Linear(2, 2)])
    assert found == {"test_a_layer_that_cannot_split_is_named.<locals>._Opaque":
                     "its kernel computes both gradients at once"}


def test_post_accumulate_hooks_see_the_final_gradient_only_at_w():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    seen = []
    weight.register_post_accumulate_grad_hook(
        lambda p: seen.append((wgrad.weight_grad_deferred(p),
                               None if p.grad is None else p.grad.clone())))
    x = torch.randn(5, 3, requires_grad=True)
    with wgrad.expecting_split_backward():
        out = _linear(x, weight)
    store = wgrad.WeightGradStore()
    with wgrad.collecting_weight_grads(store):
        out.sum().backward()
    assert seen == [(True, None)]  # at I: marked deferred, nothing accumulated
    store.run()
    assert seen[-1][0] is False
    torch.testing.assert_close(seen[-1][1], torch.ones(5, 4).t() @ x.detach())


def _linear(x, weight):
    from plugtron.api import linear

    return linear(x, weight)


def test_a_layer_that_does_not_opt_in_computes_its_weight_gradient_at_i():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(5, 3, requires_grad=True)
    with wgrad.expecting_split_backward():
        out = torch.nn.functional.linear(x, weight)  # plain torch: no deferral
    store = wgrad.WeightGradStore()
    with wgrad.collecting_weight_grads(store):
        out.sum().backward()
    assert len(store) == 0 and weight.grad is not None


def test_the_documented_third_party_layer_defers_exactly():
    # the example of docs/plugins.md, "Deferred weight gradients"
    from plugtron.api import defer_weight_grad, split_backward_expected

    class _Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(x, weight)
            ctx.weight = weight
            return x * weight

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors

            def compute():
                return (grad * x).reshape(-1, weight.shape[-1]).sum(0)
            grad_weight = None if defer_weight_grad(ctx.weight, compute) else compute()
            return grad * weight, grad_weight

    class Scale(torch.nn.Module):
        def __init__(self, size):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(size))

        def forward(self, x):
            if split_backward_expected():
                return _Scale.apply(x, self.weight)
            return x * self.weight

    torch.manual_seed(1)
    layer = Scale(8)
    with torch.no_grad():
        layer.weight.normal_()
    x, grad_out = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    want_inputs, want = _grads(layer, [layer.weight], x, grad_out, split=False)
    got_inputs, got = _grads(layer, [layer.weight], x, grad_out, split=True)
    for g, w in zip(got_inputs + got, want_inputs + want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_the_deferred_embedding_equals_the_combined_backward():
    class _Single:
        tp_group, tp_rank, tp_size = None, 0, 1

    torch.manual_seed(2)
    module = VocabParallelEmbedding(16, 6, init_method=torch.randn, parallel=_Single())
    ids = torch.randint(0, 16, (2, 3, 5))
    ids[:, 0, :2] = 7  # a row looked up several times accumulates
    grad_out = torch.randn(2, 3, 5, 6)

    def grads(split):
        module.weight.grad = None
        stores = []
        for mb in range(2):
            with wgrad.expecting_split_backward() if split else _null():
                out = module(ids[mb])
            store = wgrad.WeightGradStore()
            with wgrad.collecting_weight_grads(store) if split else _null():
                out.backward(grad_out[mb])
            stores.append(store)
        assert all(len(s) == (1 if split else 0) for s in stores)
        for store in stores:
            store.run()
        return module.weight.grad.clone()

    assert torch.equal(grads(split=True), grads(split=False))  # bitwise, here


def test_the_memory_estimate_holds_a_microbatch_until_its_w():
    from plugtron.api import estimate_memory
    from plugtron.core.contracts.activations import ChunkActivations
    from plugtron.core.tools.estimate import _held_peak
    from plugtron.testing.config import make_config

    # zb-h1 holds on every rank what 1f1b holds on its first; every W at the end holds all
    flags = {"model": "gpt", "num-layers": 4, "pp": 4, "global-batch-size": 8,
             "micro-batch-size": 1}
    peaks = {}
    for schedule in ("1f1b", "zb-h1"):
        estimate = estimate_memory(make_config({**flags, "schedule": schedule}), 4, cuda=False)
        peaks[schedule] = [r.in_flight for r in estimate.ranks]
    assert peaks["1f1b"] == [4, 3, 2, 1] and peaks["zb-h1"] == [4, 4, 4, 4]
    deferred = ([Action("F", mb) for mb in range(3)] + [Action("I", mb) for mb in range(3)]
                + [Action("W", mb) for mb in range(3)])
    # held for W: counted as stored unless the chunk says less (or more)
    assert _held_peak(deferred, [ChunkActivations(10)]) == (30, 3)
    # an I trades the 10 stored for the 4 its W keeps
    assert _held_peak(deferred, [ChunkActivations(10, 0, 4)]) == (30, 3)
    more = [Action("F", 0), Action("F", 1), Action("I", 0), Action("I", 1), Action("W", 0),
            Action("W", 1)]
    # W keeps more than was stored (12 > 10): after both I's 24 are held
    assert _held_peak(more, [ChunkActivations(10, 0, 12)]) == (24, 2)


def test_sync_points_never_mark_final_what_a_later_action_adds_to():
    from plugtron.core.pipeline.executor import sync_points

    def acts(text):
        return [Action(t[0], int(t[1])) for t in text.split()]

    # 1F1B: the last B; split: the last I (biases and the like) and the last W
    assert sync_points(acts("F0 F1 B0 B1")) == {Action("B", 1)}
    assert sync_points(acts("F0 F1 I0 W0 I1 W1")) == {Action("I", 1), Action("W", 1)}
    # DualPipeV mixes them: a B followed by a W of an earlier I is not final for the deferred
    # weights (the W adds to them), nor a W followed by a B
    assert sync_points(acts("F0 F1 I0 B1 W0")) == {Action("W", 0)}
    assert sync_points(acts("F0 F1 I0 W0 B1")) == {Action("B", 1)}
    assert sync_points(acts("F0 F1 B0 I1 W1")) == {Action("I", 1), Action("W", 1)}
