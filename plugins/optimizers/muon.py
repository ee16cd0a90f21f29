"""Optimizer ``muon``: Muon (momentum orthogonalized by Newton-Schulz) for the hidden weight
matrices, AdamW (or Lion) for the rest: embeddings, the output layer, norms, biases and every
tensor that is not 2-D (Megatron-Core's split: a parameter marked
``is_embedding_or_output_parameter`` or ``use_muon = False`` goes to the scalar optimizer).

With ``--use-distributed-optimizer`` it runs layer-wise (``plugtron.api.LayerWiseOptimizer``):
each data-parallel rank steps whole parameters, balanced by size, and shares them after the
step, so Muon still sees whole matrices while its state is split ~1/dp.
"""

from __future__ import annotations

from plugtron.api import (
    LayerWiseOptimizer,
    TorchOptimizer,
    hookimpl,
    no_weight_decay,
    optimizer_sharding_requested,
)

from .adam_options import SECTION as ADAM_SECTION
from .adam_options import adamw
from .muon_matrices import Orthogonalizer
from .muon_optimizer import MUON_GROUP, Lion, MuonWithScalar
from .muon_options import SECTION, validate_muon


def takes_muon(name: str, param) -> bool:
    """A hidden weight matrix: 2-D, not the embedding or output layer, not opted out."""
    return (param.ndim == 2 and getattr(param, "use_muon", True)
            and not getattr(param, "is_embedding_or_output_parameter", False))


def muon_groups(weight_decay: float):
    """``groups_for`` of ``TorchOptimizer``: Muon's matrices, then the scalar optimizer's
    parameters with and without weight decay (none on norms and biases)."""

    def groups_for(named):
        matrices, decay, plain = [], [], []
        for name, param in named:
            if takes_muon(name, param):
                matrices.append(param)
            else:
                (plain if no_weight_decay(name, param) else decay).append(param)
        groups = [{"params": matrices, "weight_decay": weight_decay, MUON_GROUP: True},
                  {"params": decay, "weight_decay": weight_decay},
                  {"params": plain, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    return groups_for


def make_muon(config, parallel):
    """``make_inner``: the torch optimizer over the main parameters' groups."""
    t, options = config.training, config.muon

    def scalar(groups):
        if options.muon_scalar_optimizer == "lion":
            return Lion(groups, lr=t.lr, betas=(options.lion_beta1, options.lion_beta2),
                        weight_decay=t.weight_decay)
        return adamw(config)(groups)

    def make(groups):
        return MuonWithScalar(groups, lr=t.lr, momentum=options.muon_momentum,
                              nesterov=options.muon_nesterov, weight_decay=t.weight_decay,
                              orthogonalize=Orthogonalizer(options, parallel),
                              make_scalar=scalar)

    return make


class Muon:
    @hookimpl
    def plugtron_config_sections(self):
        return [SECTION, ADAM_SECTION]  # AdamW for the scalar parameters: --adam-*

    @hookimpl
    def plugtron_validate(self, config):
        validate_muon(config)

    @hookimpl
    def optimizer_takes_dtensor_params(self, config):
        return True  # fsdp2's shards: each matrix is gathered whole for its update

    @hookimpl
    def optimizer_state_per_param(self, config, name, param):
        if takes_muon(name, param):
            return 1  # the momentum buffer
        return 1 if config.muon.muon_scalar_optimizer == "lion" else 2  # AdamW's two moments

    @hookimpl
    def optimizer_shards_layer_wise(self, config):
        return optimizer_sharding_requested(config)

    @hookimpl
    def build_optimizer(self, config, model_chunks, parallel):
        kind = LayerWiseOptimizer if optimizer_sharding_requested(config) else TorchOptimizer
        return kind(model_chunks, config, parallel, make_muon(config, parallel),
                    groups_for=muon_groups(config.training.weight_decay))
