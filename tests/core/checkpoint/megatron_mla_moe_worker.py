"""Run by test_megatron_core_mla_moe.py in a subprocess of its own (a gloo group of one):
Megatron-Core builds its GPTModel from the ``args`` that plugtron's export saved, as its
training script does (``parse_args`` defaults overlaid with the saved args, then
``core_transformer_config_from_args``, the decoder and MTP block specs), and writes the keys
and global shapes of its sharded state dict (what ``dist_checkpointing`` saves and loads) as
JSON; then loads the export into it with ``dist_checkpointing.load``, writes its logits (and
each MTP depth's loss, from a training-mode forward with labels), and saves it again with ``dist_checkpointing.save`` (in its own key names) for the import test.

Shims, for this CPU test only: the megatron_core_worker.py ones (no CUDA); ``typing.override``
(megatron.training imports it; Python 3.11 lacks it); kernel-fusion args that need CUDA, apex or
TE turned off; the local spec's core attention takes no MLA head sizes, so a parameterless
stand-in (torch's causal scaled-dot-product attention with the softmax scale MLA passes)
replaces it; Transformer Engine is absent, so the local spec is built (its norm names differ
from the TE spec's only where the test says; without query compression its separate q norm,
which Megatron refuses as unused, is left out as the TE spec leaves it).
"""

from __future__ import annotations

import json
import os
import sys
import typing

import torch


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    typing.override = getattr(typing, "override", lambda f: f)
    sys.path.insert(0, os.path.dirname(__file__))
    from megatron_core_worker import _cpu_shims

    _cpu_shims()
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args

    saved = torch.load(os.path.join(job["exported"], "common.pt"), weights_only=False)["args"]
    sys.argv = ["megatron"]
    args = parse_args(ignore_unknown_args=True)
    for name, value in vars(saved).items():
        setattr(args, name, value)
    # Kernel choices that need CUDA, apex or TE (validate_args would turn several off on such
    # a machine); none changes the model's parameters.
    args.use_cpu_initialization, args.no_persist_layer_norm = True, True
    for name in ("gradient_accumulation_fusion", "bias_swiglu_fusion", "bias_gelu_fusion",
                 "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                 "moe_permute_fusion", "moe_router_fusion"):
        setattr(args, name, False)
    config = core_transformer_config_from_args(args)

    class NoAttention(torch.nn.Module):
        """Causal softmax attention over [s, b, heads, d] (Megatron's core-attention call),
        with the scale MLA passes; no parameters."""

        def __init__(self, *a, softmax_scale=None, **k):
            super().__init__()
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, *a, **k):
            q, k_, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k_, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True)
            return out.permute(2, 0, 1, 3).flatten(2)

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=args.normalization)
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = NoAttention
        if getattr(config, "multi_latent_attention", False) and config.q_lora_rank is None:
            # No query latent, so no q norm: the TE spec's q norm rides on linear_q_up_proj,
            # which is not built then; the local spec's separate one is refused as unused.
            attention.q_layernorm = IdentityOp
    mtp = None
    if args.mtp_num_layers:
        mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False)
    model = GPTModel(config, spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type,
                     rotary_base=args.rotary_base,
                     share_embeddings_and_output_weights=not
                     args.untie_embeddings_and_output_weights,
                     mtp_block_spec=mtp)
    tensors, objects = {}, []

    def add(t) -> None:
        if isinstance(t, ShardedTensor):
            tensors[t.key] = list(t.global_shape)
        elif isinstance(t, ShardedObject):
            objects.append(t.unique_key)
        elif isinstance(t, dict):
            for v in t.values():
                add(v)
        elif isinstance(t, (list, tuple)):
            for v in t:
                add(v)
        else:  # a ShardedTensorFactory (SwiGLU's fc1): the tensors it saves
            add(t.build())

    for value in model.sharded_state_dict().values():
        add(value)
    result = {}
    if job.get("tokens") is not None:
        result["logits"] = _load_and_run(model, job, tensors, saved)
        result["mtp_losses"] = job.get("mtp_losses")
    with open(job["out"], "w") as f:
        json.dump({"tensors": tensors, "objects": sorted(set(objects)),
                   "num_moe_experts": config.num_moe_experts,
                   "q_lora_rank": getattr(config, "q_lora_rank", None),
                   "rope_type": getattr(config, "rope_type", None), **result}, f)


def _load_and_run(model, job: dict, megatron_keys, saved_args) -> list:
    """Load the export with ``dist_checkpointing.load`` (each key the local spec names
    differently read under the export's TE name: job["fused"]) and return the logits."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    def one_name(key: str) -> str:
        for te, local in job["fused"].items():
            if key.endswith(te):
                return key[:-len(te)] + local
        return key

    exported = {one_name(k): k for k in job["exported_keys"]}
    renames = {k: exported[one_name(k)] for k in megatron_keys if one_name(k) in exported}
    state = model.sharded_state_dict()

    def rename(t) -> None:
        if isinstance(t, (ShardedTensor, ShardedObject)) or hasattr(t, "key"):
            t.key = renames.get(t.key, t.key)
        if isinstance(t, dict):
            for v in t.values():
                rename(v)

    for value in state.values():
        rename(value)
    loaded = dist_checkpointing.load(state, job["exported"])
    for common in ("args", "checkpoint_version", "iteration"):
        loaded.pop(common, None)
    model.load_state_dict(loaded)
    model.eval()
    # ... and saved again by Megatron, in its local spec's own names, for the import test
    import argparse

    again = model.sharded_state_dict()
    again["args"] = argparse.Namespace(**vars(saved_args))
    os.makedirs(job["save"])
    dist_checkpointing.save(again, job["save"])
    tokens = torch.tensor(job["tokens"])
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    with torch.no_grad():
        out = model(tokens, torch.arange(seq).expand_as(tokens), mask)
        if job.get("labels") is not None and model.config.mtp_num_layers:
            # Megatron logs each MTP depth's masked mean loss in training mode only
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

            model.train()
            MTPLossLoggingHelper.tracker.clear()
            model(tokens, torch.arange(seq).expand_as(tokens), mask,
                  labels=torch.tensor(job["labels"]))
            job["mtp_losses"] = MTPLossLoggingHelper.tracker["loss_values"].tolist()
    return out.float().tolist()


if __name__ == "__main__":
    main(sys.argv[1])
