"""The load-balancing loss reaches the router in a real training step with the right sign and
scale, on every microbatch (the check the balance benchmark's anomaly asked for).

With the coefficient on or off the forward pass is the same, so the difference of the last MoE
router's gradient between the two runs is the aux loss's own gradient. The objective is
``sum_m n_m aux_m / N`` (core/training/aux_losses.py): with equal microbatches the mean over microbatches
of ``coeff x E / (k T^2) x sum_i P_i c_i``, which the test recomputes from the router's inputs
by plain autograd, with counts taken from the top-k of the softmax scores. The last layer's
router is used because its weight reaches no later layer's aux loss.
"""

from __future__ import annotations

import torch
from plugtron.core.training.grads import grad_of
from plugtron.core.training.loop import data_iterators, setup, train_step
from plugtron.core.training.optimizer import StepResult
from plugtron_moe.router import TopKRouter

from tests.utils import tiny_config

E, K, COEFF = 4, 2, 0.5


def _last_router_grad(coeff: float):
    config = tiny_config(num_experts=E, moe_router_topk=K, moe_aux_loss_coeff=coeff,
                         global_batch_size=6, micro_batch_size=2)  # 3 microbatches
    run = setup(config)
    router = [m for m in run.model_chunks[0].modules() if isinstance(m, TopKRouter)][-1]
    inputs = []
    router.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach()))
    grads = {}

    def capture():  # stands in for the optimizer: keep the finalized gradient, step nothing
        grads["w"] = grad_of(router.weight).detach().clone()
        return StepResult(True, 0.0, None)

    run.optimizer.step = capture
    train_step(run, data_iterators(run, run.datasets[0], 0))
    return grads["w"], router.weight.detach().clone(), inputs


def test_aux_loss_gradient_reaches_the_router_with_its_sign_and_scale():
    with_aux, weight, inputs = _last_router_grad(COEFF)
    without, weight0, inputs0 = _last_router_grad(0.0)
    assert torch.equal(weight, weight0) and len(inputs) == 3
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs0))  # same forward

    w = weight.clone().requires_grad_(True)
    objective = 0.0
    for x in inputs:
        scores = torch.softmax(x @ w.t(), dim=-1)
        counts = torch.zeros(E).index_add_(0, scores.topk(K, dim=-1).indices.flatten(),
                                           torch.ones(x.shape[0] * K))
        tokens = x.shape[0]
        objective = objective + COEFF * E / (K * tokens**2) * (scores.sum(0) * counts).sum()
    (objective / len(inputs)).backward()

    aux_grad = with_aux - without
    assert aux_grad.abs().max() > 1e-4  # the aux loss moves the router at all
    torch.testing.assert_close(aux_grad, w.grad, rtol=1e-4, atol=1e-7)
