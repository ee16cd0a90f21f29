"""Run by test_megatron_core.py in a subprocess of its own (a gloo group of one, Megatron's
global parallel state; or ``tp`` such processes, one per rank, for a tensor-parallel job): for
each model kind, build a tiny Megatron-Core GPTModel (local spec, tp 1 or tp, CPU), save it
with ``dist_checkpointing.save`` and its logits; then load the checkpoint that plugtron exported
(at tp 1) into a fresh GPTModel with ``dist_checkpointing.load`` and save those logits.

Megatron-Core 0.19 assumes CUDA in three places of this path even with
``use_cpu_initialization``; the shims below are for this CPU test only, each noted where set.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F


def _cpu_shims():
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device(); the async
    # filesystem writer calls torch.cuda.synchronize() before copying tensors.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import tensor_parallel

    # Core attention forks the model-parallel CUDA RNG stream around its dropout (p = 0 here).
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def build(kind: str, vocab: int, seq: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = kind == "llama"
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4,
        num_query_groups=2 if llama else None, ffn_hidden_size=48 if llama else 128,
        kv_channels=8, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm" if llama else "LayerNorm", gated_linear_unit=llama,
        activation_func=F.silu if llama else F.gelu, add_bias_linear=not llama,
        params_dtype=torch.float32, layernorm_epsilon=1e-5, init_method_std=0.2)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=seq,
                     position_embedding_type="rope" if llama else "learned_absolute",
                     rotary_base=5000, share_embeddings_and_output_weights=not llama)
    return model.eval()


def logits(model, tokens):
    """The full-vocabulary logits (at tp > 1 each rank computes its vocabulary shard: gathered
    over the tp group, which is the whole world here)."""
    import torch.distributed as dist

    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)  # True: masked out
    with torch.no_grad():
        local = model(tokens, torch.arange(seq).expand_as(tokens), mask).contiguous()
    if dist.get_world_size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts, dim=-1)


def main(job: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
    rank, tp = job.get("rank", 0), job.get("tp", 1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tp, 1)
    _cpu_shims()
    tokens = torch.tensor(job["tokens"])
    out = {}
    for kind, spec in job["kinds"].items():
        torch.manual_seed(0)
        model = build(kind, spec["vocab"], job["seq"])
        with torch.no_grad():  # norms and biases away from 1 and 0: a mix-up shows
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.3)
        state = model.sharded_state_dict()
        if spec.get("args") is not None:  # non-sharded entries land in common.pt
            import argparse

            state["args"] = argparse.Namespace(**spec["args"])
        if rank == 0:
            os.makedirs(spec["save"])
        dist.barrier()
        dist_checkpointing.save(state, spec["save"])
        out[f"{kind}_saved"] = logits(model, tokens)
        if spec.get("exported"):
            fresh = build(kind, spec["exported_vocab"], job["seq"])
            loaded = dist_checkpointing.load(fresh.sharded_state_dict(), spec["exported"])
            for common in ("args", "checkpoint_version", "iteration"):  # common.pt's part
                loaded.pop(common, None)
            fresh.load_state_dict(loaded)
            out[f"{kind}_exported"] = logits(fresh, tokens)
    if rank == 0:
        torch.save(out, job["out"])
    dist.destroy_process_group()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    if len(sys.argv) > 2:  # rank of a tp > 1 job
        job["rank"] = int(sys.argv[2])
    main(job)
