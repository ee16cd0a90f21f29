"""Megatron-Core torch_dist checkpoints written without Megatron: plugtron weights renamed into
Megatron's sharded-state-dict keys, saved with torch.distributed.checkpoint in one process.

Written from what Megatron-Core 0.19 does (megatron/core/transformer/transformer_block.py,
mlp.py, models/gpt/gpt_layer_specs.py), independently of plugtron's importer:

* ``stacked``: ``decoder.layers.<param>`` with a leading ``num_layers`` axis (the default,
  ``non_homogeneous_layers`` off); else ``decoder.layers.<i>.<param>``;
* the pre-norms under the names of the TE spec, where they live in the following linear
  (``linear_qkv.layer_norm_weight``): both specs save these keys (the local spec through its
  ``sharded_state_dict_keys_map``); ``module_norms`` writes the module names instead;
* ``spec="te"``: every TE module also has an ``_extra_state`` object;
* ``split_fc1``: SwiGLU fc1 saved as ``linear_fc1.weight_w`` / ``_v`` (singleton_local_shards);
* the word embeddings padded to Megatron's padded vocabulary; an optimizer entry and an
  ``rng_state`` object that the importer must skip.
"""

from __future__ import annotations

import io
import json
import os
import re

import torch
import torch.distributed.checkpoint as dcp

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
TE_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_"}


def megatron_keys(params: dict, num_layers: int, spec: str = "local", stacked: bool = True,
                  split_fc1: bool = False, padded_vocab: int | None = None,
                  module_norms: bool = False) -> dict:
    out, layers = {}, {}
    for name, tensor in params.items():
        match = _LAYER.match(name)
        if not match:
            if name in ("embedding.word_embeddings.weight", "output_layer.weight") \
                    and padded_vocab and tensor.shape[0] < padded_vocab:
                tensor = torch.cat([tensor, torch.randn(padded_vocab - tensor.shape[0],
                                                        *tensor.shape[1:])])
            out[name] = tensor
            continue
        i, rest = int(match.group(1)), match.group(2)
        module, _, kind = rest.rpartition(".")
        if not module_norms and module in TE_NORMS:
            rest = TE_NORMS[module] + kind
        if split_fc1 and rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2)
            layers.setdefault("mlp.linear_fc1.weight_w", {})[i] = gate
            layers.setdefault("mlp.linear_fc1.weight_v", {})[i] = up
            continue
        layers.setdefault(rest, {})[i] = tensor
    for rest, by_layer in layers.items():
        if stacked:
            out[f"decoder.layers.{rest}"] = torch.stack([by_layer[i] for i in range(num_layers)])
        else:
            out.update({f"decoder.layers.{i}.{rest}": t for i, t in by_layer.items()})
    if spec == "te":
        for module in ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "self_attention.core_attention", "mlp.linear_fc1", "mlp.linear_fc2"):
            out[f"decoder.layers.{module}._extra_state/shard_0_1"] = io.BytesIO(b"\x00fp8")
    return out


def write_torch_dist(parent: str, iteration: int, state: dict, args=None,
                     optimizer: bool = True) -> str:
    directory = os.path.join(parent, f"iter_{iteration:07d}")
    os.makedirs(directory)
    state = dict(state)
    state["rng_state/shard_0.0_1.1"] = io.BytesIO(b"rng")
    if optimizer:
        state["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(2, 2)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    common = {"checkpoint_version": 3.0, "iteration": iteration}
    if args is not None:
        common["args"] = args
    torch.save(common, os.path.join(directory, "common.pt"))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    with open(os.path.join(parent, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return directory
