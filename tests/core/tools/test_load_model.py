"""``plugtron.api.load_model``: a checkpoint as one module returning logits without padding."""

from __future__ import annotations

import pytest
import torch
from plugtron.api import load_model
from plugtron.core import checkpoint
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training import loop as training

from tests.utils import tiny_config


def _trained(tmp_path, **overrides):
    config = tiny_config(train_iters=2, save=str(tmp_path / "ck"), **overrides)
    run = training.setup(config, world=single_process())
    checkpoint.load_if_requested(run)
    training.train(run, MetricsLogger(config, rank=1))
    return run, str(tmp_path / "ck")


@pytest.mark.parametrize("overrides", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_logits_equal_the_trained_model(tmp_path, overrides):
    run, path = _trained(tmp_path, **overrides)
    model = load_model(path)
    tokens = torch.randint(0, 100, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 100)  # vocabulary padding (104) removed
    assert logits.dtype == (torch.bfloat16 if overrides else torch.float32)
    module = run.model_chunks[0].module.eval()
    with torch.no_grad():
        expected = module(tokens)[..., :100]
    assert torch.allclose(logits.float(), expected.float(), rtol=1e-6, atol=1e-6)
    assert not model.training


def test_bad_tokens_are_refused(tmp_path):
    _, path = _trained(tmp_path)
    with pytest.raises(ValueError, match="LongTensor"):
        load_model(path)(torch.zeros(2, 3))


def test_a_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError):
        load_model(str(tmp_path / "nothing"))
