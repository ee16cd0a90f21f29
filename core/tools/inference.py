"""``plugtron.api.load_model``: a checkpoint as one module in one process, for evaluation
harnesses and notebooks.

Whatever layout the checkpoint was saved with, its tensors are read into a single-process build
of the same model (tp 1, pp 1, the ``local`` layer backend, whose parameter names are those of
every backend), and the model's chunk is called as ``module(tokens)``: the model-provider
contract says a chunk built with ``pre_process`` and ``post_process`` returns logits for a
``[batch, seq]`` LongTensor.

With ``tp`` > 1 (every rank of an initialised world of that size calls it) each rank holds its
tensor-parallel shard and every rank gets the whole logits (``parallel_output`` off), so that
``plugtron generate --tp 2`` gives the tokens of tp 1.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from plugtron.core.checkpoint import CheckpointReader
from plugtron.core.checkpoint.loader import load_checkpoint
from plugtron.core.config import (
    CheckpointConfig,
    LoggingConfig,
    ParallelConfig,
    derive_padded_vocab_size,
)
from plugtron.core.interchange import hf_load
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import init_distributed, single_process
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.training.builder import build_model, reference_backend


class LoadedModel(torch.nn.Module):
    """``model(tokens)`` -> logits ``[batch, seq, vocab_size]`` (vocabulary padding removed);
    ``position_ids`` ``[batch, seq]`` default to 0..seq-1."""

    def __init__(self, module: torch.nn.Module, config, parallel=None):
        super().__init__()
        self.module = module
        self.config = config
        self.vocab_size = config.model.vocab_size
        self.parallel = parallel

    def agree(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` as tp rank 0 chose them, on every tp rank (generation keeps the ranks of
        one model in step even if their sampling ever differed)."""
        group = self.parallel.tp_group if self.parallel is not None else None
        if group is None or self.parallel.tp_size == 1:
            return tokens
        torch.distributed.broadcast(tokens, self.parallel.tp_ranks[0], group=group)
        return tokens

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None):
        if tokens.dtype != torch.long or tokens.dim() != 2:
            raise ValueError(f"tokens must be a LongTensor [batch, seq], got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        device = next(self.module.parameters()).device
        if position_ids is None:
            logits = self.module(tokens.to(device))
        else:
            logits = self.module(tokens.to(device), position_ids.to(device))
        logits = logits[..., :self.vocab_size]
        return logits if logits.dtype == torch.bfloat16 else logits.float()


def load_model(path: str, device: str | torch.device = "cpu", tp: int = 1, world=None,
               model: str | None = None, base: str | None = None) -> LoadedModel:
    """Load the model of checkpoint ``path`` (or the newest complete one in a directory of
    them, or a Hugging Face model directory, imported strictly into the ``--load HF_DIR``
    cache by the converter that reads its model_type; ``model`` chooses between two that do)
    into this process, in eval mode: fp32, or bf16 when
    the run trained in bf16. ``tp`` > 1: this rank's shard of ``world`` (default: the
    initialised one, of size tp). ``base``: the base model of a fine-tune's checkpoint that
    holds only what it trained (adapters), where the checkpoint's recorded path no longer
    holds it (``--pretrained-checkpoint``; verified by its fingerprint)."""

    if hf_load.is_hf_dir(path):
        path = hf_load.import_cached(path, model)
    reader = CheckpointReader(path)
    config = config_from_dict(reader.config)
    reader.close()
    config.parallel, config.logging = ParallelConfig(), LoggingConfig()
    config.checkpoint = CheckpointConfig(load=reader.path, pretrained_checkpoint=base)
    config.training.fp16 = False  # fp16 weights are read into fp32
    if tp == 1:
        world = single_process(str(device))
    elif world is None:

        world = init_distributed()
    if world.world_size != tp:
        raise ValueError(f"load_model with tp {tp} needs a world of {tp} ranks, not "
                         f"{world.world_size}")
    config.parallel.tensor_model_parallel_size = tp
    parallel = ParallelContext.build(world.world_size, world.rank, tp=tp, device=world.device)
    m = config.model
    m.parallel_output = False  # whole logits on every tp rank
    derive_padded_vocab_size(config, tp)
    (module,) = build_model(config, parallel, layer_backend=reference_backend(config))
    dtype = torch.bfloat16 if config.training.bf16 else torch.float32
    module.to(device=world.device, dtype=dtype)
    run = SimpleNamespace(config=config, parallel=parallel, model_chunks=[module],
                          world=SimpleNamespace(rank=1))  # rank != 0: load quietly
    load_checkpoint(run, reader.path, model_only=True)
    return LoadedModel(module, config, parallel).eval()
