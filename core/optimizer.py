"""The optimizer interface the core drives, and the wrapper over a torch optimizer that the
built-in ``adam`` and ``sgd`` plugins use.

``step()`` does what Megatron's optimizer step does: gather the gradients, compute the global
grad norm (each element once across tp, pp and shards), clip, step, and copy back to the model
parameters when the optimizer keeps fp32 main copies of lower-precision parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from . import grads as grad_utils


@dataclass
class StepResult:
    stepped: bool
    grad_norm: float
    num_zeros: int | None


class Optimizer(ABC):
    """What ``build_optimizer`` returns."""

    @property
    @abstractmethod
    def param_groups(self) -> list[dict]:
        """Groups whose ``lr`` the scheduler sets (``lr_mult`` and ``weight_decay`` inside)."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def step(self) -> StepResult: ...

    def loss_scale(self) -> float:
        """Factor the schedule multiplies the loss by before backward (fp16 scaling)."""
        return 1.0

    @abstractmethod
    def sharded_state_dict(self) -> dict:
        """Optimizer state keyed by parameter name, with how each tensor is sharded."""

    @abstractmethod
    def load_sharded_state_dict(self, state: dict) -> None: ...


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and norm weights (every 1-D tensor) are not decayed."""
    return param.ndim == 1 or name.endswith(".bias")


def named_params(model_chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, param) for every trainable parameter of this rank. Models name parameters by
    global layer index, so names are unique across chunks and the same in every layout."""
    out = []
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, param in module.named_parameters():
            if param.requires_grad:
                out.append((name, param))
    return out


def param_groups_for(model_chunks, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for name, param in named_params(model_chunks):
        (plain if no_weight_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class TorchOptimizer(Optimizer):
    """A torch optimizer over fp32 main parameters.

    With fp32 model parameters the main parameters are the model parameters themselves; with
    bf16/fp16 ones, fp32 copies are kept and stepped, then copied back.
    """

    def __init__(self, model_chunks, config, parallel, make_inner):
        self.config = config
        self.parallel = parallel
        self.model_params = [p for _, p in named_params(model_chunks)]
        self.names = [n for n, _ in named_params(model_chunks)]
        self.mixed = any(p.dtype != torch.float32 for p in self.model_params)
        if self.mixed:
            self.main_params = [torch.nn.Parameter(p.detach().float().clone())
                                for p in self.model_params]
        else:
            self.main_params = self.model_params
        by_id = {id(m): main for m, main in zip(self.model_params, self.main_params)}
        groups = []
        for group in param_groups_for(model_chunks, config.training.weight_decay):
            groups.append({**group, "params": [by_id[id(p)] for p in group["params"]]})
        self.inner = make_inner(groups)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
        if self.mixed:
            for p in self.main_params:
                p.grad = None

    def _main_grads(self) -> list[torch.Tensor]:
        out = []
        for model_p, main_p in zip(self.model_params, self.main_params):
            g = grad_utils.grad_of(model_p)
            if g is None:
                g = torch.zeros_like(main_p)
            main_p.grad = g if g.dtype == torch.float32 and main_p is model_p else g.float()
            out.append(main_p.grad)
        return out

    def step(self) -> StepResult:
        grads = self._main_grads()
        counted = [g for g, p in zip(grads, self.model_params)
                   if grad_utils.counts_for_norm(p, self.parallel)]
        norm = grad_utils.global_norm(grad_utils.local_sq_norm(counted), self.parallel)
        grad_utils.clip_(grads, norm, self.config.training.clip_grad)
        num_zeros = None
        if self.config.logging.log_num_zeros_in_grad:
            num_zeros = grad_utils.count_zeros(counted, self.parallel)
        self.inner.step()
        if self.mixed:
            with torch.no_grad():
                for model_p, main_p in zip(self.model_params, self.main_params):
                    model_p.copy_(main_p)
        return StepResult(True, norm, num_zeros)

    def sharded_state_dict(self) -> dict:
        """``{param name: {key: tensor shaped like the param}}``; the step count (a scalar in
        torch's per-param state) goes under ``"__optimizer__"``."""
        state, steps = {}, set()
        for name, main_p in zip(self.names, self.main_params):
            state[name] = {}
            for key, value in self.inner.state.get(main_p, {}).items():
                if key == "step":
                    steps.add(float(value))
                elif torch.is_tensor(value):
                    state[name][key] = value
            if self.mixed:
                state[name]["main_param"] = main_p.detach()
        state["__optimizer__"] = {"step": max(steps) if steps else 0.0}
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        step = float(state.get("__optimizer__", {}).get("step", 0.0))
        for name, model_p, main_p in zip(self.names, self.model_params, self.main_params):
            saved = state.get(name, {})
            if self.mixed:
                # Without saved main params (a checkpoint of an fp32 run) start them from the
                # loaded model params.
                source = saved.get("main_param", model_p)
                with torch.no_grad():
                    main_p.copy_(source)
            entries = {k: v for k, v in saved.items() if k != "main_param"}
            if entries:
                if step:
                    entries["step"] = torch.tensor(step, dtype=torch.float32)
                self.inner.state[main_p] = entries
