"""Layer type ``E``: pre-norm mixture of experts, ``hidden + dropout(moe(norm(hidden)))``.

Children as in Megatron-Core, so parameters read ``decoder.layers.{i}.pre_mlp_layernorm.*``,
``decoder.layers.{i}.mlp.router.weight``, ``.mlp.experts.local_experts.{e}.linear_fc{1,2}.*``
(global expert index e) and ``.mlp.shared_experts.*``. The layer also answers
``substitutes_for``: it takes the place of the MLP ``-`` on the layers ``--moe-layer-freq``
selects when ``--num-experts`` is set, which is how the GPT model uses it without importing
this package.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from plugtron.api import ConfigError, ConfigSection, add_loss, recompute, recompute_module

from .dispatcher import load_dispatcher
from .experts import SequentialMLP, local_expert_ids
from .options import MoEOptions, moe_layer_pattern
from .router import TopKRouter
from .shared_experts import SharedExpertMLP
from .validate import validate


class MoE(torch.nn.Module):
    """``mlp`` of an MoE layer: router, dispatcher, experts, shared experts."""

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        o = config.moe
        if not o.num_experts:
            raise ConfigError(f"layer {layer_number} is an MoE layer (E), which needs "
                              f"--num-experts")
        prefix = f"decoder.layers.{layer_number - 1}.mlp"
        self.router = TopKRouter(config, parallel, f"{prefix}.router", seed, layer_number)
        ids = local_expert_ids(o.num_experts, parallel.ep_size, parallel.ep_rank)
        self.experts = SequentialMLP(config, parallel, f"{prefix}.experts", seed, ids)
        self.experts.rng_tracker = getattr(backend, "rng_tracker", None)
        self.shared_experts = (SharedExpertMLP(config, backend, f"{prefix}.shared_experts", seed)
                               if o.moe_shared_expert_intermediate_size else None)
        dispatcher_cls = load_dispatcher(o.moe_token_dispatcher_type)
        # Not a module: it holds no parameters, only the recipe for moving tokens.
        self.dispatcher = dispatcher_cls(config, parallel, o.num_experts, ids)
        self.recompute_shared = recompute_module(config, "shared_experts")

    def forward(self, x: torch.Tensor):
        """``x`` ``[b, s, h]`` -> ``(output [b, s, h], aux losses)``."""
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        self.router._seq_shape = (s, b)
        probs, routing_map, aux = self.router(tokens)
        dispatched = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(dispatched.tokens, dispatched.tokens_per_expert)
        out = self.dispatcher.combine(expert_output, dispatched).view(b, s, h)
        if self.shared_experts is not None:
            out = out + (recompute(self.shared_experts, x) if self.recompute_shared
                         else self.shared_experts(x))
        return out, aux


class MoELayer(torch.nn.Module):
    symbol = "E"
    #: The parts --recompute-granularity selective may recompute (--recompute-modules).
    recompute_modules = ("moe", "moe_act", "shared_experts", "layernorm")
    supports_kv_cache = True  # per token: nothing to keep between generation steps
    # Per token, but for the router's balancing statistics, which it sums over cp.
    supports_context_parallel = True

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        m = config.model
        self.layer_number = layer_number
        self.per_layer_logging = config.moe.moe_per_layer_logging
        self.pre_mlp_layernorm = backend.norm(m.hidden_size)
        self.mlp = MoE(config, backend, parallel, layer_number, seed)
        self.hidden_dropout = m.hidden_dropout
        self.backend = backend
        self.recompute_norm = recompute_module(config, "layernorm")
        self.recompute_moe = recompute_module(config, "moe")
        self.topk, self.num_experts = config.moe.moe_router_topk, config.moe.num_experts
        self.swiglu = m.swiglu

    def activation_bytes(self, shape) -> int:
        """Bytes kept for backward per microbatch (``plugtron estimate``), approximately: the
        norm, the router's input and fp32 logits and probabilities, the top-k routed copies of
        the tokens through an expert MLP (fc1 input, activation, fc2 input), the weighted
        combine, a shared expert like an MLP, the residual dropout mask. Routed tokens are
        counted as k x this rank's tokens (even routing; tests/core/tools/test_memory_estimate.py holds it
        within 30% of autograd's saved tensors)."""
        h = self.pre_mlp_layernorm.weight.shape[0]
        tokens, e = shape.tokens, shape.dtype_bytes
        total = 2 * shape.residual(h) + shape.residual(2, 4)  # norm input and stats, router
        total += 3 * tokens * self.num_experts * 4  # router logits, scores, probabilities
        if self.recompute_moe:
            return total + shape.dropout_mask(h, self.hidden_dropout)
        expert = next(iter(self.mlp.experts.local_experts.values()), None)
        if expert is not None:
            ffn = expert.get_parameter("linear_fc2.weight").shape[-1]
            routed = tokens * self.topk
            total += routed * (2 * h + (4 if self.swiglu else 2) * ffn) * e + routed * 8
        shared = self.mlp.shared_experts
        if shared is not None:
            ffn = shared.get_parameter("linear_fc2.weight").shape[1]
            total += shape.residual(h) + shape.tensor((4 if self.swiglu else 2) * ffn)
        return total + shape.dropout_mask(h, self.hidden_dropout)

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        normed = (recompute(self.pre_mlp_layernorm, hidden) if self.recompute_norm
                  else self.pre_mlp_layernorm(hidden))
        # --recompute-modules moe: the whole MoE (router, dispatch, experts) runs again in
        # backward; the router counts nothing twice there (is_recomputing)
        out, aux = recompute(self.mlp, normed) if self.recompute_moe else self.mlp(normed)
        if self.hidden_dropout and self.training:
            # Under SP each tp rank holds other tokens: draw from the tp-rank-specific stream.
            sp = self.backend.sequence_parallel
            with self.backend.dropout_rng() if sp else contextlib.nullcontext():
                out = F.dropout(out, self.hidden_dropout, True)
        out = hidden + out
        for name, loss in aux:
            out = add_loss(out, name, loss)
            if self.per_layer_logging:  # report only: a detached value adds nothing to backward
                out = add_loss(out, f"{name} layer {self.layer_number}", loss.detach())
        return out

    # ------------------------------------------------------------------ plugin side

    @staticmethod
    def plugtron_config_sections():
        return [ConfigSection("moe", MoEOptions, title="Mixture of experts")]

    @staticmethod
    def plugtron_validate(config, world_size):
        validate(config, world_size)

    @classmethod
    def substitutes_for(cls, config, symbol: str, layer_number: int) -> bool:
        """``E`` runs in place of the MLP ``-`` on the MoE layers of an MoE run."""
        moe = getattr(config, "moe", None)
        if symbol != "-" or moe is None or not moe.num_experts:
            return False
        return moe_layer_pattern(moe.moe_layer_freq, config.model.num_layers)[layer_number - 1]
