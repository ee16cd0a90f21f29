"""The ``moe`` extension plugin: what the MoE layers need between steps.

* Aux-loss-free balancing (``--moe-router-enable-expert-bias``): after each step every router's
  ``expert_bias`` moves by ``rate x sign(mean(c) - c)``, with c its tokens per expert summed over
  tp x dp (x cp) (Megatron's ``get_updated_expert_bias``), so every replica keeps the same bias.
* ``global_aux_loss``: the counts accumulated over the global batch start again.

Registered in the ``plugtron`` group, so it runs in every run; without MoE layers it does
nothing. ``-p no:moe`` turns it off (the bias then stays where it is).
"""

from __future__ import annotations

import torch
from plugtron.api import all_reduce, hookimpl

from .router import TopKRouter
from .routing import updated_expert_bias


class ExpertBiasUpdater:
    def __init__(self):
        self.routers: list[TopKRouter] = []
        self.groups: list = []

    @hookimpl
    def plugtron_model_built(self, config, model_chunks, parallel):
        self.routers = [module for chunk in model_chunks for module in chunk.modules()
                        if isinstance(module, TopKRouter)]
        self.groups = [parallel.tp_group, parallel.dp_cp_group]

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        for router in self.routers:
            router.reset_global_aux_loss()
            if router.expert_bias is None:
                continue
            counts = router.local_tokens_per_expert
            for group in self.groups:
                all_reduce(counts, group)
            rate = router.options.moe_router_bias_update_rate
            with torch.no_grad():
                router.expert_bias.copy_(updated_expert_bias(counts, router.expert_bias, rate))
                counts.zero_()
