"""Hugging Face interchange for the GPT plugin: tiny random Llama and GPT-2 models made here
(no downloads). plugtron's loss on a batch equals transformers' within 1e-4; export after import
gives back the same tensors; a plugtron checkpoint exported and imported again keeps its
weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader, checkpointer, load_checkpoint
from plugtron.core.config import TrainConfig
from plugtron.core.distributed import single_process
from plugtron.core.training import setup

from .helpers import ckpt_config

transformers = pytest.importorskip("transformers")

ONE = single_process()
VOCAB, SEQ = 100, 16


def _randomize(model) -> None:
    """Norm weights and biases away from 1 and 0, so a mix-up of them shows in the loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)


def make_hf(kind: str, directory: str):
    torch.manual_seed(0)
    if kind.startswith("llama"):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2 if "gqa" in kind else 4,
            max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2,
            tie_word_embeddings="tied" in kind, attention_bias="bias" in kind,
            mlp_bias="bias" in kind, rope_theta=5000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=32, activation_function="gelu",
                                         initializer_range=0.2, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    _randomize(model)
    model.eval()
    model.save_pretrained(directory)
    return model


def run_for(path: str):
    """A one-process run built from the checkpoint's own config, weights loaded."""
    config = TrainConfig.from_dict(CheckpointReader(path).config)
    for key, value in {"data": "mock", "seq_length": SEQ, "hidden_dropout": 0.0,
                       "attention_dropout": 0.0, "micro_batch_size": 2, "global_batch_size": 2,
                       "train_iters": 1, "progress": False}.items():
        from plugtron.core.config import apply_values

        apply_values(config, {key: value}, "test")
    config.model.padded_vocab_size = None
    run = setup(config, world=ONE)
    load_checkpoint(run, path, model_only=True)
    return run


def plugtron_token_losses(run, tokens, labels):
    model = run.model_chunks[0]
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, labels=labels).float()


def hf_token_losses(model, tokens, labels):
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                           reduction="none").view_as(labels)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-tied-bias", "gpt2"])
def test_import_matches_transformers_and_exports_back(kind, tmp_path):
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model = make_hf(kind, hf_dir)
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", "import-hf", hf_dir, ckpt])
    assert result.exit_code == 0, result.output
    assert "model flags:" in result.output

    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    ours = plugtron_token_losses(run_for(ckpt), tokens, labels)
    theirs = hf_token_losses(model, tokens, labels)
    assert abs(theirs.mean().item() - torch.log(torch.tensor(float(VOCAB))).item()) > 0.05
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    assert abs(ours.mean().item() - theirs.mean().item()) <= 1e-4

    result = runner.invoke(cli, ["convert", "export-hf", ckpt, back])
    assert result.exit_code == 0, result.output
    original = model.state_dict()
    reloaded = type(model).from_pretrained(back).state_dict()
    assert set(reloaded) == set(original)
    for name, value in original.items():
        assert torch.equal(reloaded[name], value), name


@pytest.mark.parametrize("layout", ["gpt2-like", "llama-like"])
def test_plugtron_checkpoint_export_import_round_trip(layout, tmp_path):
    settings = {} if layout == "gpt2-like" else {
        "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
        "num_query_groups": 2, "untie_embeddings_and_output_weights": True,
        "add_bias_linear": False}
    run = setup(ckpt_config(save=str(tmp_path / "save"), **settings), world=ONE)
    checkpointer(run).save(0)
    saved = str(tmp_path / "save")
    runner = CliRunner()
    assert runner.invoke(cli, ["convert", "export-hf", saved, str(tmp_path / "hf")]).exit_code == 0
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["model_type"] == ("gpt2" if layout == "gpt2-like" else "llama")
    result = runner.invoke(cli, ["convert", "import-hf", str(tmp_path / "hf"),
                                 str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    before, after = CheckpointReader(saved), CheckpointReader(str(tmp_path / "again"))
    names = sorted(n for n in before.tensors if n.startswith("model/"))
    assert names == sorted(after.tensors)
    for name in names:
        a, b = before.read_full(name), after.read_full(name)
        if "word_embeddings" in name or "output_layer" in name:
            a, b = a[:VOCAB], b[:VOCAB]  # padding rows are not part of the model
        assert torch.equal(a, b), name


def test_unsupported_models_are_refused(tmp_path):
    # gelu_new converts (--openai-gelu, test_hf_families.py); relu has no plugtron flag.
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4,
                                     n_positions=32, bos_token_id=0, eos_token_id=0,
                                     activation_function="relu")
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path / "hf"))
    result = CliRunner().invoke(cli, ["convert", "import-hf", str(tmp_path / "hf"),
                                      str(tmp_path / "out")])
    assert result.exit_code == 2 and "'relu'" in result.output
    assert not os.path.exists(tmp_path / "out")
    result = CliRunner().invoke(cli, ["convert", "import-hf", str(tmp_path), str(tmp_path / "o")])
    assert result.exit_code == 2 and "config.json" in result.output
