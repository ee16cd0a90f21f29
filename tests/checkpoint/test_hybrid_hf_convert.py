"""Hugging Face interchange of the Hybrid model: tiny random Mamba2 and NemotronH models built
from configs here (no downloads). plugtron's logits equal transformers' own CPU forward (its
pure-torch path) within 1e-5 (fp32); export after import gives back byte-identical tensors."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader, load_checkpoint
from plugtron.core.config import apply_values
from plugtron.core.distributed import single_process
from plugtron.core.plugin_options import config_from_dict
from plugtron.core.training import setup

transformers = pytest.importorskip("transformers")

ONE = single_process()
VOCAB, SEQ = 100, 13  # 13 tokens: not a multiple of the chunk (4)
MAMBA = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_heads=8, head_dim=8,
             n_groups=2, expand=2, chunk_size=4, layer_norm_epsilon=1e-5)


def _randomize(model) -> None:
    """Norms, D and conv biases away from their inits, so a mix-up shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith((".D", "bias")):
                p.add_(torch.randn_like(p) * 0.2)


def make_hf(kind: str, directory: str):
    torch.manual_seed(0)
    if kind.startswith("mamba2"):
        config = transformers.Mamba2Config(num_hidden_layers=2, initializer_range=0.2,
                                           tie_word_embeddings="tied" in kind, **MAMBA)
        model = transformers.Mamba2ForCausalLM(config)
    else:
        config = transformers.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern="M*-M-*",
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, chunk_size=4,
            layer_norm_epsilon=1e-5, initializer_range=0.2, use_mamba_kernels=False,
            tie_word_embeddings=False, time_step_min=0.01)
        model = transformers.NemotronHForCausalLM(config)
    _randomize(model)
    model.eval()
    model.save_pretrained(directory)
    return model


def run_for(path: str):
    config = config_from_dict(CheckpointReader(path).config)
    apply_values(config, {"data": "mock", "seq_length": SEQ, "micro_batch_size": 2,
                          "global_batch_size": 2, "train_iters": 1, "progress": False,
                          "hidden_dropout": 0.0, "attention_dropout": 0.0}, "test")
    config.model.padded_vocab_size = None
    run = setup(config, world=ONE)
    load_checkpoint(run, path, model_only=True)
    return run


@pytest.mark.parametrize("kind", ["mamba2", "mamba2-tied", "nemotron_h"])
def test_import_matches_transformers_and_exports_back(kind, tmp_path):
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model = make_hf(kind, hf_dir)
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", "import-hf", "--model", "hybrid", hf_dir, ckpt])
    assert result.exit_code == 0, result.output

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ours_model = run_for(ckpt).model_chunks[0]
    ours_model.eval()
    with torch.no_grad():
        ours = ours_model(tokens)[..., :VOCAB].float()
        theirs = model(tokens).logits.float()
    scale = theirs.abs().max()
    assert scale > 0.1
    assert (ours - theirs).abs().max() <= 1e-5 * scale, (ours - theirs).abs().max() / scale

    result = runner.invoke(cli, ["convert", "export-hf", ckpt, back])
    assert result.exit_code == 0, result.output
    original = model.state_dict()
    reloaded = type(model).from_pretrained(back).state_dict()
    assert set(reloaded) == set(original)
    for name, value in original.items():
        assert torch.equal(reloaded[name], value), name


def test_moe_layers_are_refused(tmp_path):
    from plugtron.core.errors import ConfigError
    from plugtron_gpt.hybrid_hf_convert import nemotron_h_pattern

    with pytest.raises(ConfigError, match="only M, \\* and - layers convert"):
        nemotron_h_pattern({"hybrid_override_pattern": "ME*"})
