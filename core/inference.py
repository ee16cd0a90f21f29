"""``plugtron.api.load_model``: a checkpoint as one module in one process, for evaluation
harnesses and notebooks.

Whatever layout the checkpoint was saved with, its tensors are read into a single-process build
of the same model (tp 1, pp 1, the ``local`` layer backend, whose parameter names are those of
every backend), and the model's chunk is called as ``module(tokens)``: the model-provider
contract says a chunk built with ``pre_process`` and ``post_process`` returns logits for a
``[batch, seq]`` LongTensor.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import registry
from .config import CheckpointConfig, LoggingConfig, ParallelConfig, padded_vocab_size
from .distributed import single_process
from .parallel_context import ParallelContext


class LoadedModel(torch.nn.Module):
    """``model(tokens)`` -> logits ``[batch, seq, vocab_size]`` (vocabulary padding removed)."""

    def __init__(self, module: torch.nn.Module, config):
        super().__init__()
        self.module = module
        self.config = config
        self.vocab_size = config.model.vocab_size

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype != torch.long or tokens.dim() != 2:
            raise ValueError(f"tokens must be a LongTensor [batch, seq], got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        device = next(self.module.parameters()).device
        logits = self.module(tokens.to(device))
        logits = logits[..., :self.vocab_size]
        return logits if logits.dtype == torch.bfloat16 else logits.float()


def load_model(path: str, device: str | torch.device = "cpu", model: str = "gpt") -> LoadedModel:
    """Load the model of checkpoint ``path`` (or the newest complete one in a directory of
    them, or a Hugging Face model directory, imported strictly into the ``--load HF_DIR``
    cache with converter plugin ``model``) into this process, in eval mode: fp32, or bf16 when
    the run trained in bf16."""
    from .checkpoint import CheckpointReader, hf_load
    from .checkpoint.loader import load_checkpoint
    from .plugin_manager import new_plugin_manager
    from .plugin_options import config_from_dict

    if hf_load.is_hf_dir(path):
        path = hf_load.import_cached(path, model)
    reader = CheckpointReader(path)
    config = config_from_dict(reader.config)
    reader.close()
    config.parallel, config.logging = ParallelConfig(), LoggingConfig()
    config.checkpoint = CheckpointConfig(load=reader.path)
    config.training.fp16 = False  # fp16 weights are read into fp32
    world = single_process(str(device))
    parallel = ParallelContext.build(1, 0, device=world.device)
    m = config.model
    m.padded_vocab_size = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    pm = new_plugin_manager()
    pm.register(registry.instantiate(registry.load("model", config.plugins.model)), name="model")
    backend = registry.load("layer_backend", "local")(config, parallel)
    module = pm.hook.model_provider(config=config, pre_process=True, post_process=True,
                                    vp_stage=None, layer_backend=backend, parallel=parallel)
    dtype = torch.bfloat16 if config.training.bf16 else torch.float32
    module.to(device=world.device, dtype=dtype)
    run = SimpleNamespace(config=config, parallel=parallel, pm=pm, model_chunks=[module],
                          world=SimpleNamespace(rank=1))  # rank != 0: load quietly
    load_checkpoint(run, reader.path, model_only=True)
    return LoadedModel(module, config).eval()
