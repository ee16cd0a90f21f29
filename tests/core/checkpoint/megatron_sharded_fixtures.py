"""Megatron-Core torch_dist checkpoints as a tp x pp job writes them, without megatron-core:
every rank of a gloo world saves its own pieces with torch.distributed.checkpoint, as Megatron's
``dist_checkpointing`` (torch_dist strategy, ``keep_only_main_replica``) does.

Written from Megatron-Core 0.19 (dist_checkpointing/strategies/torch.py, transformer_block.py,
mlp.py, tensor_parallel/layers.py), independently of plugtron's importer:

* a tensor is a ShardedTensor with its *global* shape; each rank contributes the chunks it holds
  (offsets into the global tensor), and a chunk that several ranks hold (a replica: norms, the
  row-parallel biases, position embeddings) is written by the first of them only;
* tensor parallel: column-parallel weights and biases (word embeddings, output layer,
  ``linear_qkv``, ``linear_fc1``) are cut along rows, row-parallel weights (``linear_proj``,
  ``linear_fc2``) along columns. SwiGLU's fc1 holds ``[gate_r; up_r]`` on rank r and is saved
  as two chunks, gate at row ``r*g`` and up at row ``G + r*g`` of the global ``[gate; up]``;
* pipeline parallel: stage p holds layers ``p*L/P ..``; stacked keys carry the *global* layer
  index as the offset on the leading (prepended) axis, chunk size 1 there; per-layer keys
  (non_homogeneous_layers) name the global index. Embeddings live on the first stage, the final
  norm and the output layer on the last; a tied output layer is a replica of the embeddings and
  is not written;
* the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by x tp``;
* rank order tp fastest: rank = tp_rank + tp * pp_rank.
"""

from __future__ import annotations

import io
import json
import os
import re

import torch

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight",
         "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
_COLUMNS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def _tp_pieces(name: str, tensor: torch.Tensor, tp: int, swiglu: bool):
    """[(tp_rank, offsets, piece)] of one global (unstacked) tensor: a replica has one piece,
    owned by tp rank 0."""
    if name.endswith(_ROWS):
        if swiglu and ".mlp.linear_fc1." in f".{name}":
            gate, up = tensor.chunk(2)
            g = gate.shape[0] // tp
            return [(r, (half * gate.shape[0] + r * g,) + (0,) * (tensor.dim() - 1),
                     part[r * g:(r + 1) * g])
                    for r in range(tp) for half, part in enumerate((gate, up))]
        rows = tensor.shape[0] // tp
        return [(r, (r * rows,) + (0,) * (tensor.dim() - 1), tensor[r * rows:(r + 1) * rows])
                for r in range(tp)]
    if name.endswith(_COLUMNS):
        cols = tensor.shape[1] // tp
        return [(r, (0, r * cols), tensor[:, r * cols:(r + 1) * cols]) for r in range(tp)]
    return [(0, (0,) * tensor.dim(), tensor)]


def global_plan(params: dict, num_layers: int, tp: int, pp: int, swiglu: bool,
                stacked: bool = True, tied: bool = True, spec: str = "local") -> dict:
    """{key: (global shape, [(rank, offsets, chunk)])} for plugtron's tp-1 ``params`` (vocab
    tensors already padded); the same on every rank."""
    per_stage = num_layers // pp
    plan: dict = {}
    for name, tensor in params.items():
        match = _LAYER.match(name)
        if match:
            layer, rest = int(match.group(1)), match.group(2)
            for module, fused in _FUSED_NORMS.items():
                if rest.startswith(module):
                    rest = fused + rest[len(module):]
            stage = layer // per_stage
        else:
            rest = name
            stage = pp - 1 if name.startswith(("decoder.final_layernorm", "output_layer")) else 0
        if name == "output_layer.weight" and tied:
            continue
        for tp_rank, offsets, piece in _tp_pieces(rest, tensor, tp, swiglu):
            rank = tp_rank + tp * stage
            if not match:
                key, shape = rest, tuple(tensor.shape)
            elif stacked:
                key, shape = f"decoder.layers.{rest}", (num_layers, *tensor.shape)
                offsets, piece = (layer, *offsets), piece.unsqueeze(0)
            else:
                key, shape = f"decoder.layers.{layer}.{rest}", tuple(tensor.shape)
            plan.setdefault(key, (shape, []))[1].append((rank, offsets,
                                                         piece.contiguous().clone()))
    if spec == "te":  # TE modules' fp8 state: one ShardedObject per layer and tp rank
        for module in ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2"):
            for layer in range(num_layers):
                for r in range(tp):
                    key = (f"decoder.layers.{module}._extra_state/"
                           f"shard_{layer}.{r}_{num_layers}.{tp}")
                    plan[key] = (None, [(r + tp * (layer // per_stage), None, b"\x00fp8")])
    return plan


def _sharded_tensor(rank: int, shape, chunks):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
        TensorProperties,
    )

    meta = [ShardMetadata(list(offsets), list(piece.shape), f"rank:{owner}/cpu")
            for owner, offsets, piece in chunks]
    local = [Shard(piece, m) for (owner, _, piece), m in zip(chunks, meta) if owner == rank]
    dtype = chunks[0][2].dtype
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(meta, torch.Size(shape), props), process_group=None)


def save_sharded(rank: int, world_size: int, plan: dict, directory: str) -> None:
    """Run on every rank of a ``tp x pp`` gloo world: this rank's chunks of ``plan`` (plus an
    rng state object of its own and an optimizer tensor), one ``dcp.save`` across the world
    into ``directory`` (made by the caller, who writes common.pt: :func:`write_common`)."""
    import torch.distributed.checkpoint as dcp

    state = {}
    for key, (shape, chunks) in plan.items():
        if shape is None:
            if chunks[0][0] == rank:
                state[key] = io.BytesIO(chunks[0][2])
        elif any(owner == rank for owner, _, _ in chunks):
            state[key] = _sharded_tensor(rank, shape, chunks)
    state[f"rng_state/shard_0.{rank}_1.{world_size}"] = io.BytesIO(b"rng")
    state[f"optimizer.state.exp_avg.r{rank}"] = torch.zeros(2)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))


def write_common(parent: str, iteration: int, args) -> str:
    """``parent/iter_XXXXXXX`` with common.pt (``args`` unless None), metadata.json and
    ``latest_checkpointed_iteration.txt``: what rank 0 writes besides its chunks."""
    directory = os.path.join(parent, f"iter_{iteration:07d}")
    os.makedirs(directory)
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
