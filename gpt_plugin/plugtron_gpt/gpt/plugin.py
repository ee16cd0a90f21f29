"""The ``gpt`` model plugin: model_provider, forward_step and loss_func hooks."""

from __future__ import annotations

import torch
from plugtron.api import (
    ModelInfo,
    check_context_parallel_layers,
    check_finite,
    hookimpl,
    load_layer_types,
    loss_closure,
)
from plugtron_gpt.gpt.loss_options import SECTION as LOSS_SECTION
from plugtron_gpt.gpt.model import GPTModel, gpt_layer_symbols
from plugtron_gpt.gpt.mtp import SECTION as MTP_SECTION
from plugtron_gpt.gpt.mtp import validate_mtp
from plugtron_gpt.gpt.presets import PRESETS
from plugtron_gpt.gpt.sizes import architecture, validate_sizes

#: The report key of the GPT model's loss (Megatron's).
MAIN_LOSS = "lm loss"


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked sum of per-token losses, the token count, and the report."""
    mask = loss_mask.reshape(-1).float()
    losses = output_tensor.reshape(-1).float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum()
    check_finite(loss_sum, "lm loss")
    report = {MAIN_LOSS: torch.stack([loss_sum.detach(), num_tokens.detach()])}
    return loss_sum, num_tokens, report


class GPTPlugin:
    #: positions come from the batch's position_ids, so each cp rank's slice is placed right
    supports_context_parallel = True

    @hookimpl
    def plugtron_config_sections(self):
        return [MTP_SECTION, LOSS_SECTION]

    @hookimpl
    def plugtron_validate(self, config):
        validate_sizes(config)
        validate_mtp(config)
        if config.parallel.context_parallel_size > 1:  # the registry is read only when needed
            check_context_parallel_layers(
                config, load_layer_types(gpt_layer_symbols(config)).values())

    @hookimpl
    def model_info(self, config):
        return ModelInfo(main_loss=MAIN_LOSS, architecture=architecture(config))

    @hookimpl
    def model_presets(self):
        return PRESETS

    @hookimpl
    def model_provider(self, config, pre_process, post_process, vp_stage, layer_backend,
                       parallel):
        return GPTModel(config, layer_backend, parallel, pre_process, post_process, vp_stage)

    @hookimpl
    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        device = next(model.parameters()).device
        tokens = batch["tokens"].to(device, non_blocking=True)
        position_ids = batch["position_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        # --reset-attention-mask: each token's document number (every stage draws the batch)
        document_ids = batch.get("attention_mask")
        if document_ids is not None:
            document_ids = document_ids.to(device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(device)
        output = model(tokens, position_ids, labels=labels, document_ids=document_ids,
                       loss_mask=loss_mask)
        return output, loss_closure(loss_mask)

    @hookimpl
    def loss_func(self, loss_mask, output_tensor):
        return loss_func(loss_mask, output_tensor)
