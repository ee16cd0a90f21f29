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
from plugtron.core.checkpoint import checkpointer
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup

from tests.core.checkpoint.helpers import ckpt_config
from tests.core.checkpoint.hf_models import (
    assert_exports_back,
    assert_same_checkpoint_tensors,
    convert,
    run_for,
    save_random,
    tokens,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 16


def make_hf(kind: str, directory: str):
    if kind.startswith("llama"):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2 if "gqa" in kind else 4,
            max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2,
            tie_word_embeddings="tied" in kind, attention_bias="bias" in kind,
            mlp_bias="bias" in kind, rope_theta=5000.0)
        return save_random(transformers.LlamaForCausalLM, config, directory)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=32, activation_function="gelu",
                                     initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    return save_random(transformers.GPT2LMHeadModel, config, directory)


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
    result = convert("import-hf", hf_dir, ckpt)
    assert "model flags:" in result.output

    ids = tokens(VOCAB, (2, SEQ + 1))
    batch, labels = ids[:, :-1], ids[:, 1:]
    ours = plugtron_token_losses(run_for(ckpt, SEQ), batch, labels)
    theirs = hf_token_losses(model, batch, labels)
    assert abs(theirs.mean().item() - torch.log(torch.tensor(float(VOCAB))).item()) > 0.05
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    assert abs(ours.mean().item() - theirs.mean().item()) <= 1e-4

    assert_exports_back(model, ckpt, back)


@pytest.mark.parametrize("layout", ["gpt2-like", "llama-like"])
def test_plugtron_checkpoint_export_import_round_trip(layout, tmp_path):
    settings = {} if layout == "gpt2-like" else {
        "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
        "num_query_groups": 2, "untie_embeddings_and_output_weights": True,
        "add_bias_linear": False}
    saved, hf_dir, again = (str(tmp_path / n) for n in ("save", "hf", "again"))
    run = setup(ckpt_config(save=saved, **settings), world=single_process())
    checkpointer(run).save(0)
    convert("export-hf", saved, hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == ("gpt2" if layout == "gpt2-like" else "llama")
    convert("import-hf", hf_dir, again)
    assert_same_checkpoint_tensors(saved, again, VOCAB)


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
