"""Shared set-up of the Hugging Face interchange tests (test_hf_convert, test_hf_families,
test_hf_moe, test_hybrid_hf_convert): tiny random transformers models saved from configs (no
downloads), the CLI's import and export, a one-process run built from a checkpoint, and the
round-trip comparisons. Each test module keeps its own cases and tolerances; only the
mechanics live here. Import it after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader, load_checkpoint
from plugtron.core.config_flags import apply_values
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.training.loop import setup


def randomize(model) -> None:
    """Norm weights, biases and Mamba's D away from their inits (1, 0, 1), so that a mix-up
    of two of them shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith((".D", "bias")):
                p.add_(torch.randn_like(p) * 0.2)


def save_random(model_cls, config, directory: str):
    """``model_cls(config)`` with seed 0, randomized, in eval mode, saved to ``directory``."""
    torch.manual_seed(0)
    model = model_cls(config)
    randomize(model)
    model.eval()
    model.save_pretrained(directory)
    return model


def tokens(vocab: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The same token batch for every test (its own generator: the global seed is untouched)."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(3))


def convert(*args: str, exit_code: int = 0):
    """``plugtron convert ARGS``; asserts the exit code and returns the click result."""
    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == exit_code, result.output
    return result


def run_for(path: str, seq: int):
    """A one-process run built from the checkpoint's own config (mock data, no dropout), its
    weights loaded."""
    config = config_from_dict(CheckpointReader(path).config)
    apply_values(config, {"data": "mock", "seq_length": seq, "micro_batch_size": 2,
                          "global_batch_size": 2, "train_iters": 1, "progress": False,
                          "hidden_dropout": 0.0, "attention_dropout": 0.0}, "test")
    config.model.padded_vocab_size = None
    run = setup(config, world=single_process())
    load_checkpoint(run, path, model_only=True)
    return run


def logits_of(path: str, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    """The checkpoint's logits on ``batch`` (eval mode, fp32), without vocabulary padding."""
    chunk = run_for(path, batch.shape[1]).model_chunks[0]
    chunk.eval()
    with torch.no_grad():
        return chunk(batch)[..., :vocab].float()


def assert_exports_back(model, ckpt: str, back: str):
    """``export-hf`` of ``ckpt`` gives back every tensor of ``model`` bit for bit; returns the
    reloaded transformers model."""
    convert("export-hf", ckpt, back)
    reloaded = type(model).from_pretrained(back)
    original, again = model.state_dict(), reloaded.state_dict()
    assert set(again) == set(original)
    for name, value in original.items():
        assert torch.equal(again[name], value), name
    return reloaded


def assert_same_checkpoint_tensors(saved: str, again: str, vocab: int) -> tuple:
    """Every model tensor of ``saved`` is in ``again``, equal (embedding and output rows beyond
    ``vocab`` are padding, not part of the model); returns both readers."""
    before, after = CheckpointReader(saved), CheckpointReader(again)
    names = sorted(n for n in before.tensors if n.startswith("model/"))
    assert names == sorted(after.tensors)
    for name in names:
        a, b = before.read_full(name), after.read_full(name)
        if "word_embeddings" in name or "output_layer" in name:
            a, b = a[:vocab], b[:vocab]
        assert torch.equal(a, b), name
    return before, after
