"""TopKRouter (``mlp.router``): gating linear, scores, top-k, capacity, aux losses, z-loss.

The router's weight ``[experts, hidden]`` is replicated on every rank. Under sequence
parallelism each tp rank routes its own tokens, so the weight is marked ``sequence_parallel``
(its gradient is summed over tp) and the balancing statistics are summed over tp; under context
parallelism each cp rank routes its chunks of every sequence, so they are summed over cp as
well (Megatron's ``tp_cp_group`` reductions). Each rank's loss term is its tokens' share of the
whole microbatch's; the shares are added over cp with their gradients
(``sum_over_context_parallel``: every cp rank weights the term by its own token count) and
reported whole over tp.
"""

from __future__ import annotations

import torch
from plugtron.api import (
    all_reduce,
    group_size,
    is_recomputing,
    linear,
    mark_sequence_parallel,
    normal_init,
    sum_over_context_parallel,
)

from . import routing
from .options import load_balancing, uses_sinkhorn

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _reported_whole(local: torch.Tensor, group) -> torch.Tensor:
    """``local`` for the gradient, but the group's sum as value: each tp rank's term covers its
    own tokens, the gradients add up over tp, and the reported value is the whole loss."""
    if group_size(group) == 1:
        return local
    total = all_reduce(local.detach().clone(), group)
    return local + (total - local.detach())


class TopKRouter(torch.nn.Module):
    #: buffers (None when their option is off)
    expert_bias: torch.Tensor | None
    local_tokens_per_expert: torch.Tensor | None

    def __init__(self, config, parallel, prefix: str, seed: int, layer_number: int):
        super().__init__()
        m, o = config.model, config.moe
        self.options, self.layer_number = o, layer_number
        self.num_experts, self.topk = o.num_experts, o.moe_router_topk
        self.balancing = load_balancing(o)  # [(type, coefficient, reported name)]
        self.sinkhorn = uses_sinkhorn(o)
        self.weight = torch.nn.Parameter(
            normal_init(m.init_method_std, seed, f"{prefix}.weight")((o.num_experts,
                                                                       m.hidden_size)))
        self.sequence_parallel = bool(config.parallel.sequence_parallel) and parallel.tp_size > 1
        self.tp_group = parallel.tp_group if self.sequence_parallel else None
        # tp x dp (x cp) sum of tokens per expert, for global_aux_loss (as Megatron's
        # tp_dp_cp group); under tp without SP every tp rank sees the same tokens.
        self.token_groups = [self.tp_group, parallel.dp_cp_group]
        # aux_loss and seq_aux_loss count the microbatch's tokens: tp (under sp) x cp.
        self.cp_group = parallel.cp_group
        self.microbatch_groups = [self.tp_group, self.cp_group]
        if self.sequence_parallel:
            mark_sequence_parallel(self.weight)
        self.register_buffer("expert_bias", torch.zeros(o.num_experts, dtype=torch.float32)
                             if o.moe_router_enable_expert_bias else None)
        # Not persistent: counts since the last bias update (reset after each step).
        self.register_buffer("local_tokens_per_expert",
                             torch.zeros(o.num_experts, dtype=torch.float32)
                             if o.moe_router_enable_expert_bias else None, persistent=False)
        # global_aux_loss: counts over the global batch
        self.global_tokens_per_expert: torch.Tensor | None = None
        self.ga_steps = 0
        # global_aux_loss under activation recompute: a microbatch's rerun in backward uses the
        # counts its first run used (microbatches run backward in forward order, per layer).
        self.replayed_counts: list[torch.Tensor] = []

    # ------------------------------------------------------------------ pieces

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _DTYPES.get(self.options.moe_router_dtype, x.dtype)
        # plugtron.api.linear: in a split backward the router weight's gradient (through the
        # cast to the router dtype) waits for W
        return linear(x.to(dtype), self.weight.to(dtype))

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.options.moe_input_jitter_eps
        if not (eps and self.training):
            return x
        noise = torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return x * noise

    def reset_global_aux_loss(self) -> None:
        """Start a new global batch (called after each step)."""
        self.global_tokens_per_expert, self.ga_steps = None, 0
        self.replayed_counts = []

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor):
        """``x`` ``[tokens, hidden]`` -> ``(probs, routing_map, aux)`` where ``aux`` is a list of
        ``(name, loss)`` pairs to add through ``add_loss`` (the layer attaches them)."""
        o = self.options
        logits = self.gating(self.jitter(x))
        aux = []
        if o.moe_z_loss_coeff is not None and self.training and torch.is_grad_enabled():
            ranks = group_size(self.tp_group) * group_size(self.cp_group)  # equal shares
            local = routing.z_loss(logits, o.moe_z_loss_coeff / ranks)
            aux.append(("z_loss", self._whole(local)))
        if self.sinkhorn:
            probs, routing_map = routing.sinkhorn_routing(logits, self.topk, self.training)
        else:
            probs, routing_map = routing.topk_routing(
                logits, self.topk, o.moe_router_pre_softmax, o.moe_router_num_groups,
                o.moe_router_group_topk, o.moe_router_topk_scaling_factor,
                o.moe_router_score_function, self.expert_bias)
        if o.moe_expert_capacity_factor is not None:
            probs, routing_map = routing.apply_token_dropping(
                probs, routing_map, self.topk, o.moe_expert_capacity_factor,
                o.moe_token_drop_policy, o.moe_pad_expert_input_to_capacity,
                batch_size=self._seq_shape[1])
        if self.training and torch.is_grad_enabled() and self.balancing:
            # Every balancing loss uses the same scores and their plain top-k (Megatron's
            # compute_routing_scores_for_aux_loss), each with its own coefficient.
            aux_map, scores = routing.scores_for_aux_loss(logits, self.topk,
                                                          o.moe_router_score_function)
            for kind, coeff, name in self.balancing:
                aux.append((name, self.balancing_loss(kind, coeff, aux_map, scores,
                                                      x.shape[0])))
        if (self.local_tokens_per_expert is not None and torch.is_grad_enabled()
                and not is_recomputing()):  # a recomputed forward counts nothing twice
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map, aux

    def balancing_loss(self, kind: str, coeff: float, aux_map: torch.Tensor,
                       scores: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """One balancing loss (``aux_loss``, ``seq_aux_loss`` or ``global_aux_loss``) of the
        scores and their top-k map, times ``coeff``."""
        if kind == "seq_aux_loss":
            return self._seq_aux_loss(aux_map, scores, coeff)
        groups = self.microbatch_groups if kind == "aux_loss" else self.token_groups
        counts = aux_map.sum(dim=0).float()
        total = float(num_tokens)
        for group in groups:
            all_reduce(counts, group)
            total *= group_size(group)
        if kind == "global_aux_loss" and is_recomputing():
            counts = self.replayed_counts.pop(0)
        elif kind == "global_aux_loss":
            # Counts accumulate over the microbatches of the global batch (Megatron's
            # global_tokens_per_expert / ga_steps).
            self.global_tokens_per_expert = counts if self.global_tokens_per_expert is None \
                else self.global_tokens_per_expert + counts
            self.ga_steps += 1
            counts = self.global_tokens_per_expert / self.ga_steps
            self.replayed_counts.append(counts)
        local = routing.switch_load_balancing_loss(scores, counts, total, self.topk,
                                                   self.num_experts, coeff)
        if kind == "global_aux_loss":
            # Each dp rank's term covers its own tokens of the global batch (its cp ranks'
            # shares added); times dp it is an estimate of the whole, whose dp mean (the
            # core's normalisation) is the whole.
            local = local * (group_size(self.token_groups[-1]) // group_size(self.cp_group))
        return self._whole(local)

    def _whole(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's share of a loss term -> the microbatch's term: summed over cp with its
        gradient, reported whole over tp."""
        return _reported_whole(sum_over_context_parallel(local, self.cp_group), self.tp_group)

    def _seq_aux_loss(self, aux_map, scores, coeff) -> torch.Tensor:
        """Per sequence, then averaged: the batch is folded into the expert dimension."""
        seq, batch = self._seq_shape
        per_seq_map = aux_map.reshape(batch, seq, -1).transpose(0, 1).reshape(seq, -1)
        per_seq_scores = scores.reshape(batch, seq, -1).transpose(0, 1).reshape(seq, -1)
        counts = per_seq_map.sum(dim=0).float()
        total = float(seq)
        for group in self.microbatch_groups:  # each sequence's tokens: tp (sp) x cp ranks
            all_reduce(counts, group)
            total *= group_size(group)
        local = routing.switch_load_balancing_loss(per_seq_scores, counts, total, self.topk,
                                                   self.num_experts, coeff) / batch
        return self._whole(local)

    _seq_shape = (1, 1)  # (sequence length, batch) of the current input; set by the layer
