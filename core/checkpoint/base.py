"""The base model a fine-tune starts from (``--pretrained-checkpoint`` with ``--finetune``):
which tensors are the base's and how a base checkpoint is named (loading it: loader.py).

A fine-tune loads the base checkpoint's model weights only, leaving out the tensors the run's
model transforms added (adapters); the run stays at iteration 0 with a fresh optimizer and
schedule. When transforms added tensors, the fine-tune's own checkpoints hold what it trains
(the added tensors and any trainable parameter) and not the frozen base a second time; they
name the base instead (``base_checkpoint`` in the metadata: its path, iteration and
fingerprint, the SHA-256 of its metadata file). Loading such a checkpoint loads the base
first and refuses a base with another fingerprint; a resumed run must be given the base again
(``--pretrained-checkpoint``), ``load_model`` finds it at the recorded path.
"""

from __future__ import annotations

import hashlib
import os

import torch
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.parallel.sharding import added_by_transform

#: Metadata key of a checkpoint that holds what a fine-tune trains, not its base.
BASE_KEY = "base_checkpoint"


def is_base_tensor(tensor: torch.Tensor) -> bool:
    """A tensor of the base model that the fine-tune does not change: not added by a
    transform, not trained."""
    return added_by_transform(tensor) is None and not tensor.requires_grad


def identity(reader: CheckpointReader) -> dict:
    """What names and verifies a base checkpoint."""
    with open(reader.metadata_path, "rb") as file:
        fingerprint = hashlib.sha256(file.read()).hexdigest()
    return {"path": os.path.abspath(reader.path), "iteration": reader.iteration,
            "fingerprint": fingerprint}


def saves_without_base(run) -> bool:
    """Whether this run's checkpoints leave the base out: it started from a base checkpoint
    and its transforms added tensors."""
    if getattr(run, "base_checkpoint", None) is None:
        return False
    return any(added_by_transform(tensor) is not None for chunk in run.model_chunks
               for tensor in getattr(chunk, "module", chunk).state_dict(keep_vars=True).values())
