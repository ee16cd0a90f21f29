"""The te backend's linears under a split backward, in one process on the CPU stand-in of
tests/fake_transformer_engine.py: with transformer-engine's delayed wgrad their weight gradients
(and a bias added in the GEMM) wait for ``W`` and equal the combined backward's bitwise; a TE
without it keeps them at ``I`` and says so. fp32."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.training.recompute import recompute
from plugtron.plugins.layer_backends import te
from plugtron.plugins.layer_backends.te_wgrad import cannot_delay_reason

from tests import fake_transformer_engine
from tests.utils import tiny_config

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_GPU = torch.cuda.is_available()


def _backend(delay_wgrad=True):
    """On the stand-in; ``delay_wgrad=None``: on the installed transformer-engine."""
    if delay_wgrad is None:
        return te.TEBackend(tiny_config(), ParallelContext.build(1, 0))
    with fake_transformer_engine.installed(delay_wgrad):
        return te.TEBackend(tiny_config(), ParallelContext.build(1, 0))


def _init(shape):
    return torch.randn(shape)


@pytest.fixture(params=[True, "always"], ids=["newest-te", "te-2.4-to-2.15"])
def delay(request):
    """Both ways TE's forward captures its store: only while it is on, or always."""
    return request.param


def _layer(kind, delay_wgrad=True):
    """A te linear with a bias: ``column`` adds it in TE's GEMM, ``row`` after (TE returns it),
    ``nobias`` has none."""
    torch.manual_seed(0)
    backend = _backend(delay_wgrad)
    if kind == "row":
        module = backend.row_parallel_linear(8, 6, bias=True, init_method=_init)
    else:
        module = backend.column_parallel_linear(8, 6, bias=kind == "column", init_method=_init)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))  # a non-zero bias, so that its gradient is checked
    return module


def _out(module, x):
    out, bias = module(x)
    return out if bias is None else out + bias


def _run(module, xs, grads, split, order=None):
    """Forward and backward of each microbatch; split: ``I`` each, then the ``W``'s in
    ``order``. Returns the input gradients and the parameters' gradients."""
    stores, input_grads = [], []
    for x, grad in zip(xs, grads):
        x = x.clone().requires_grad_()
        with wgrad.expecting_split_backward() if split else _nothing():
            out = _out(module, x)
        if split:
            store = wgrad.WeightGradStore()
            with wgrad.collecting_weight_grads(store):
                out.backward(grad)
            stores.append(store)
        else:
            out.backward(grad)
        input_grads.append(x.grad)
    for i in order or range(len(stores)):
        stores[i].run()
    return input_grads, {n: p.grad.clone() for n, p in module.named_parameters()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _data(microbatches=3, device="cpu"):
    torch.manual_seed(1)
    return ([torch.randn(2, 5, 8, device=device) for _ in range(microbatches)],
            [torch.randn(2, 5, 6, device=device) for _ in range(microbatches)])


@pytest.mark.parametrize("kind", ["column", "row", "nobias"])
def test_te_linears_defer_to_w_and_equal_the_combined_backward_bitwise(kind, delay):
    xs, grads = _data()
    module = _layer(kind, delay)
    assert type(module).weight_grads_at_input is None
    assert wgrad.weight_grads_at_input([module]) == {}
    want_inputs, want = _run(module, xs, grads, split=False)
    module.zero_grad(set_to_none=True)
    got_inputs, got = _run(module, xs, grads, split=True)
    for g, w in zip(got_inputs, want_inputs):
        assert torch.equal(g, w)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert module._plugtron_wgrad.issued == 3 and not module._plugtron_wgrad.tickets
    assert module.wgrad_store.context.qsize() == 0
    assert not module.wgrad_store.delay_wgrad_compute()  # off again outside split microbatches


def test_after_i_the_weight_and_gemm_bias_have_nothing_and_w_adds_it(delay):
    module = _layer("column", delay)
    seen = []
    module.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append((wgrad.weight_grad_deferred(p),
                               None if p.grad is None else p.grad.clone())))
    x = torch.randn(2, 5, 8, requires_grad=True)
    with wgrad.expecting_split_backward():
        out = _out(module, x)
    store = wgrad.WeightGradStore()
    with wgrad.collecting_weight_grads(store):
        out.sum().backward()
    assert x.grad is not None
    assert module.weight.grad is None and module.bias.grad is None
    assert len(store) == 2 and module.wgrad_store.context.qsize() == 1  # one GEMM, two grads
    assert all(d for d, _ in seen) and all(g is None for _, g in seen)
    store.run()
    flat = x.detach().reshape(-1, 8)
    ones = torch.ones(flat.shape[0], 6)
    assert torch.equal(module.weight.grad, ones.t() @ flat)
    assert torch.equal(module.bias.grad, ones.sum(dim=0))
    assert seen[-1][0] is False and torch.equal(seen[-1][1], module.weight.grad)
    assert module.wgrad_store.context.qsize() == 0


def test_combined_backwards_queue_nothing(delay):
    module = _layer("column", delay)
    x = torch.randn(2, 5, 8, requires_grad=True)
    _out(module, x).sum().backward()  # no split: TE computes the weight gradient itself
    assert module.weight.grad is not None and module.wgrad_store.context.qsize() == 0
    with torch.no_grad(), wgrad.expecting_split_backward():
        _out(module, x)  # evaluation under a split flag: nothing to queue either
    assert module._plugtron_wgrad.issued == 0


def test_a_split_forward_whose_backward_does_not_collect_gets_its_gradients_at_once(delay):
    xs, grads = _data(1)
    module = _layer("column", delay)
    _, want = _run(module, xs, grads, split=False)
    module.zero_grad(set_to_none=True)
    x = xs[0].clone().requires_grad_()
    with wgrad.expecting_split_backward():
        out = _out(module, x)
    out.backward(grads[0])  # no WeightGradStore collecting: popped and returned now
    for name, p in module.named_parameters():
        assert torch.equal(p.grad, want[name]), name
    assert module.wgrad_store.context.qsize() == 0 and not module._plugtron_wgrad.tickets


def test_ws_out_of_i_order_are_refused_with_a_clear_error(delay):
    xs, grads = _data(2)
    module = _layer("column", delay)
    with pytest.raises(RuntimeError, match="first in, first out.*not the oldest"):
        _run(module, xs, grads, split=True, order=[1, 0])


@pytest.mark.parametrize("after", ["gelu", "nothing"])
def test_recomputed_forward_inside_i_defers_the_same_gradients(after, delay):
    # The recompute runs inside I: before the layer's backward window opens (``gelu``: its
    # saved input is unpacked first) or inside it (``nothing``: TE's own saved tensors are the
    # first). The store must come back as it was, and only the first forward's GEMM is queued.
    act = torch.nn.functional.gelu if after == "gelu" else (lambda t: t)
    xs, grads = _data(2)
    want = _layer("column", delay)
    for x, grad in zip(xs, grads):
        act(_out(want, x)).backward(grad)
    module = _layer("column", delay)
    stores = []
    for x, grad in zip(xs, grads):
        x = x.clone().requires_grad_()
        with wgrad.expecting_split_backward():
            out = recompute(lambda t: act(_out(module, t)), x)
        store = wgrad.WeightGradStore()
        with wgrad.collecting_weight_grads(store):
            out.backward(grad)
        assert module.weight.grad is None and not module.wgrad_store.delay_wgrad_compute()
        stores.append(store)
    assert module.wgrad_store.context.qsize() == 2
    for store in stores:
        store.run()
    for (name, p), w in zip(module.named_parameters(), want.parameters()):
        assert torch.equal(p.grad, w.grad), name


def test_a_te_without_delayed_wgrad_keeps_its_weight_gradients_at_i_and_says_so():
    xs, grads = _data()
    module = _layer("column", delay_wgrad=False)
    reason = type(module).weight_grads_at_input
    assert "no delay_wgrad_compute" in reason
    assert wgrad.weight_grads_at_input([module]) == {type(module).__qualname__: reason}
    assert not hasattr(module, "wgrad_store")
    _, want = _run(module, xs, grads, split=False)
    module.zero_grad(set_to_none=True)
    x = xs[0].clone().requires_grad_()
    with wgrad.expecting_split_backward():
        out = _out(module, x)
    store = wgrad.WeightGradStore()
    with wgrad.collecting_weight_grads(store):
        out.backward(grads[0])
    assert len(store) == 0 and module.weight.grad is not None  # computed at I
    module.zero_grad(set_to_none=True)
    _, got = _run(module, xs, grads, split=True)
    for name in want:
        assert torch.equal(got[name], want[name]), name


class _LinearWithAStoreThatCannotSwitch(torch.nn.Module):
    """A Linear that takes ``delay_wgrad_compute`` but whose module has no store class with
    the switches (this test module defines no ``WeightGradStore``)."""

    def __init__(self, in_features, out_features, delay_wgrad_compute=False):
        super().__init__()


def test_the_guard_reads_the_signature_and_the_store_class():
    assert cannot_delay_reason(fake_transformer_engine.module()) is None
    assert "no delay_wgrad_compute" in cannot_delay_reason(
        fake_transformer_engine.module(delay_wgrad=False))

    class _TE:
        Linear = _LinearWithAStoreThatCannotSwitch

    assert "cannot be switched on and off" in cannot_delay_reason(_TE)


@pytest.mark.skipif(not (HAVE_TE and HAVE_GPU), reason="needs transformer-engine and a CUDA GPU")
@pytest.mark.parametrize("kind", ["column", "row", "nobias"])
def test_the_installed_te_defers_its_weight_gradients_exactly_on_a_gpu(kind):
    xs, grads = _data(device="cuda")
    module = _layer(kind, delay_wgrad=None)
    want_inputs, want = _run(module, xs, grads, split=False)
    module.zero_grad(set_to_none=True)
    got_inputs, got = _run(module, xs, grads, split=True)
    # the same TE kernels on the same operands, only later: equal
    for g, w in zip(got_inputs + list(got.values()), want_inputs + list(want.values())):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
    if type(module).weight_grads_at_input is None:  # this TE delays: every GEMM was queued
        assert module._plugtron_wgrad.issued == 3 and not module._plugtron_wgrad.tickets
