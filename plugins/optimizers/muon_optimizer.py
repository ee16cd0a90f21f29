"""The torch optimizer of ``--optimizer muon``: Muon over the hidden weight matrices, a scalar
optimizer (AdamW, or Lion) over everything else, as one ``torch.optim.Optimizer`` so plugtron's
``TorchOptimizer`` (fp32 main parameters, the global norm and clipping, checkpoint state by
name) and ``LayerWiseOptimizer`` (each matrix stepped on one data-parallel rank) drive it.

Muon's step for a matrix ``W`` with gradient ``G`` (torch.optim.Muon's, and Megatron-Core's):
``B <- momentum B + (1 - momentum) G``; the update is ``B``, or ``G + momentum (B - G)`` with
Nesterov; ``W <- W (1 - lr wd) - lr O`` where ``O`` is the orthogonalized update, scaled for
the matrix's shape (muon_matrices.py). Its one state tensor is ``momentum_buffer``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Key of the groups Muon steps; the other groups belong to the scalar optimizer.
MUON_GROUP = "muon"


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) for the parameters Muon leaves, ``--muon-scalar-optimizer lion``:
    every element moves by ``lr`` along ``sign(beta1 m + (1 - beta1) g)``; one moment."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                moment = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.lerp(p.grad, moment, beta1).sign_(), alpha=-group["lr"])
                moment.lerp_(p.grad, 1 - beta2)


class MuonWithScalar(torch.optim.Optimizer):
    """Muon over the groups marked ``"muon": True``, ``make_scalar(groups)`` over the others.

    Both see the same group dicts (the LR schedule sets ``lr`` once for both) and the same
    ``state``. ``orthogonalize(param, update)`` returns the scaled orthogonalized update of a
    matrix (fp32, shaped like ``param``)."""

    def __init__(self, groups: list[dict], *, lr: float, momentum: float, nesterov: bool,
                 weight_decay: float, orthogonalize: Callable, make_scalar: Callable):
        super().__init__(groups, {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                                  "weight_decay": weight_decay})
        self.orthogonalize = orthogonalize
        scalar = [g for g in self.param_groups if not g.get(MUON_GROUP)]
        self.scalar = make_scalar(scalar) if scalar else None
        if self.scalar is not None:
            self.scalar.state = self.state  # one state, saved and loaded by parameter

    def state_names(self, param: torch.Tensor) -> set[str]:
        """The state tensors a parameter has here (checkpoints from another optimizer are
        refused by them)."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                if group.get(MUON_GROUP):
                    return {"momentum_buffer"}
                break
        if isinstance(self.scalar, Lion):
            return {"exp_avg"}
        return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group.get(MUON_GROUP):
                continue
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                buffer = self.state[p].get("momentum_buffer")
                if buffer is None:
                    buffer = self.state[p]["momentum_buffer"] = torch.zeros_like(grad)
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                orthogonal = self.orthogonalize(p, update)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(orthogonal, alpha=-lr)
        if self.scalar is not None:
            self.scalar.step()
