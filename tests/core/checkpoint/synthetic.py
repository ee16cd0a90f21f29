"""Synthetic multi-rank checkpoints written and read in one process.

A layout's ranks are simulated with real ``ParallelContext`` objects (no process groups) and
modules that hold exactly the shards the GPT model would hold: tensor-parallel splits along the
declared dimension (SwiGLU fc1 per block), pipeline placement by global layer, the tied output
weight on the last stage, vocabulary padded for the layout's tp. This exercises the resharding
code before the tensor- and pipeline-parallel layers exist.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from plugtron.core.checkpoint import state, writer
from plugtron.core.config import padded_vocab_size
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import WorldInfo
from plugtron.core.parallel.sharding import set_tensor_parallel, shard_of
from plugtron.core.pipeline.layout import chunk_layers
from plugtron.core.training.state import TrainState

from tests.utils import tiny_config

VOCAB, DIVISIBLE, LAYERS, HIDDEN, FFN, HEADS, GROUPS = 100, 8, 4, 16, 32, 4, 2
MAX_PADDED = 128  # padded vocabulary at tp 4
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


def full_tensors(untied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """The global tensors, vocabulary tensors at the largest padding any layout here uses."""
    g = torch.Generator().manual_seed(seed)
    qkv_rows = (HEADS + 2 * GROUPS) * (HIDDEN // HEADS)
    out = {EMBEDDING: torch.randn(MAX_PADDED, HIDDEN, generator=g),
           FINAL_NORM: torch.randn(HIDDEN, generator=g)}
    if untied:
        out["output_layer.weight"] = torch.randn(MAX_PADDED, HIDDEN, generator=g)
    for i in range(LAYERS):
        layer = f"decoder.layers.{i}"
        out[f"{layer}.input_layernorm.weight"] = torch.randn(HIDDEN, generator=g)
        out[f"{layer}.self_attention.linear_qkv.weight"] = torch.randn(qkv_rows, HIDDEN,
                                                                       generator=g)
        out[f"{layer}.self_attention.linear_qkv.bias"] = torch.randn(qkv_rows, generator=g)
        out[f"{layer}.self_attention.linear_proj.weight"] = torch.randn(HIDDEN, HIDDEN,
                                                                        generator=g)
        out[f"{layer}.mlp.linear_fc1.weight"] = torch.randn(2 * FFN, HIDDEN, generator=g)
        out[f"{layer}.mlp.linear_fc2.weight"] = torch.randn(HIDDEN, FFN, generator=g)
    return out


#: name suffix -> (partition dim, chunks); absent: replicated over tp
SHARDING = {"word_embeddings.weight": (0, 1), "output_layer.weight": (0, 1),
            "linear_qkv.weight": (0, 1), "linear_qkv.bias": (0, 1),
            "linear_proj.weight": (1, 1), "linear_fc1.weight": (0, 2),
            "linear_fc2.weight": (1, 1)}


def sharding_of(name: str):
    return next((v for k, v in SHARDING.items() if name.endswith(k)), None)


def module_of(named: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module whose ``state_dict`` has exactly these dotted names."""
    root = torch.nn.Module()
    for name, param in named.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, param)
    return root


class FakeOptimizer:
    """State derived elementwise from the parameters, so it shards exactly like them."""

    def __init__(self, named):
        self.named = named
        self.loaded = None

    def sharded_state_dict(self):
        out = {n: {"exp_avg": p.detach() * 2 + 1, "exp_avg_sq": p.detach() ** 2}
               for n, p in self.named}
        out["__optimizer__"] = {"step": 5.0, "scale": torch.tensor(2.0)}
        return out

    def load_sharded_state_dict(self, loaded):
        self.loaded = loaded


def layout_config(tp, pp, vp, untied):
    config = tiny_config(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
                         num_attention_heads=HEADS, num_query_groups=GROUPS, swiglu=True,
                         vocab_size=VOCAB, make_vocab_size_divisible_by=DIVISIBLE, tp=tp, pp=pp,
                         vp=vp, untie_embeddings_and_output_weights=untied)
    config.model.padded_vocab_size = padded_vocab_size(VOCAB, DIVISIBLE, tp)
    return config


def rank_run(full, tp, pp, vp, dp, rank, untied, fill=None):
    """One simulated rank: its shards of ``full`` (or of ``fill(shape)`` when given)."""
    world = tp * pp * dp
    parallel = ParallelContext.build(world, rank, tp=tp, pp=pp, vp=vp, create_groups=False)
    config = layout_config(tp, pp, vp, untied)
    padded = config.model.padded_vocab_size
    chunks, named = [], []
    for v in range(vp or 1):
        pre = parallel.pp_rank == 0 and v == 0
        post = parallel.pp_rank == pp - 1 and v == (vp or 1) - 1
        names = [EMBEDDING] if pre else []
        layers = chunk_layers(LAYERS, pp, parallel.pp_rank, vp, v if vp else None)
        names += [n for n in full if n.startswith("decoder.layers.")
                  and int(n.split(".")[2]) in layers]
        if post:
            names.append(FINAL_NORM)
            if untied or not pre:
                names.append("output_layer.weight")
        params = {}
        for name in names:
            source = name
            if name == "output_layer.weight" and not untied:
                source = EMBEDDING  # tied copy: the embedding's values
            tensor = full[source]
            if tensor.shape[0] == MAX_PADDED:
                tensor = tensor[:padded]
            how = sharding_of(name)
            shard = shard_of(tensor, how[0], parallel.tp_rank, tp, how[1]) if how else tensor
            if fill is not None:
                shard = fill(shard.shape)
            param = torch.nn.Parameter(shard.clone())
            if how:
                set_tensor_parallel(param, *how)
            if not untied and pp > 1 and name in (EMBEDDING, "output_layer.weight"):
                param.shared_group = "embedding.word_embeddings.weight"
            params[name] = param
        chunks.append(module_of(params))
        named += list(params.items())
    scheduler = SimpleNamespace(state_dict=lambda: {"num_steps": 5},
                                load_state_dict=lambda s: None)
    return SimpleNamespace(config=config, parallel=parallel,
                           world=WorldInfo(rank, world, rank, world, torch.device("cpu")),
                           model_chunks=chunks, optimizer=FakeOptimizer(named),
                           state=TrainState(5, 40), scheduler=scheduler, pm=None)


def save_layout(parent, full, tp, pp, vp, dp, untied, iteration=5) -> str:
    """Every rank of the layout writes its files; rank 0 commits."""
    import os

    from plugtron.core.checkpoint import layout

    tmp = os.path.join(parent, layout.tmp_dirname(iteration))
    world = tp * pp * dp
    metadata = None
    for rank in range(world):
        run = rank_run(full, tp, pp, vp, dp, rank, untied)
        snap, global_state = state.snapshot(run, copy=False)
        writer.write_rank_files(tmp, snap)
        if rank == 0:
            metadata = state.run_metadata(run, global_state)
    return writer.commit(parent, tmp, iteration, metadata, list(range(world)))


def expected_shard(full, name, run, untied) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, mask of the elements that must match) of ``name`` on ``run``'s rank."""
    p = run.parallel
    padded = run.config.model.padded_vocab_size
    source = EMBEDDING if name == "output_layer.weight" and not untied else name
    tensor = full[source]
    mask = torch.ones_like(tensor, dtype=torch.bool)
    if tensor.shape[0] == MAX_PADDED:
        tensor, mask = tensor[:padded], mask[:padded].clone()
        mask[VOCAB:] = False  # padding rows: whatever the layout had
    how = sharding_of(name)
    if how:
        tensor = shard_of(tensor, how[0], p.tp_rank, p.tp_size, how[1])
        mask = shard_of(mask, how[0], p.tp_rank, p.tp_size, how[1])
    return tensor, mask
