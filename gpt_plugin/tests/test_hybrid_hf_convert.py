"""Hugging Face interchange of the Hybrid model: tiny random Mamba2 and NemotronH models built
from configs here (no downloads). plugtron's logits equal transformers' own CPU forward (its
pure-torch path) within 1e-5 (fp32); export after import gives back byte-identical tensors."""

from __future__ import annotations

import pytest
import torch

from tests.core.checkpoint.hf_models import (
    assert_exports_back,
    convert,
    logits_of,
    save_random,
    tokens,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 13  # 13 tokens: not a multiple of the chunk (4)
MAMBA = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_heads=8, head_dim=8,
             n_groups=2, expand=2, chunk_size=4, layer_norm_epsilon=1e-5)


def make_hf(kind: str, directory: str):
    if kind.startswith("mamba2"):
        config = transformers.Mamba2Config(num_hidden_layers=2, initializer_range=0.2,
                                           tie_word_embeddings="tied" in kind, **MAMBA)
        return save_random(transformers.Mamba2ForCausalLM, config, directory)
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern="M*-M-*",
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, chunk_size=4,
        layer_norm_epsilon=1e-5, initializer_range=0.2, use_mamba_kernels=False,
        tie_word_embeddings=False, time_step_min=0.01, time_step_limit=(0.05, float("inf")))
    return save_random(transformers.NemotronHForCausalLM, config, directory)


@pytest.mark.parametrize("kind", ["mamba2", "mamba2-tied", "nemotron_h"])
def test_import_matches_transformers_and_exports_back(kind, tmp_path):
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model = make_hf(kind, hf_dir)
    # the converter is found by config.json's model_type: no --model hybrid
    result = convert("import-hf", hf_dir, ckpt)
    assert "--model hybrid" in result.output or "hybrid" in result.output

    batch = tokens(VOCAB, (2, SEQ))
    ours = logits_of(ckpt, batch, VOCAB)
    with torch.no_grad():
        theirs = model(batch).logits.float()
    scale = theirs.abs().max()
    assert scale > 0.1
    assert (ours - theirs).abs().max() <= 1e-5 * scale, (ours - theirs).abs().max() / scale

    assert_exports_back(model, ckpt, back)


def test_moe_layers_are_refused(tmp_path):
    from plugtron.core.errors import ConfigError
    from plugtron_gpt.hybrid.hf_convert import nemotron_h_pattern

    with pytest.raises(ConfigError, match="only M, \\* and - layers convert"):
        nemotron_h_pattern({"hybrid_override_pattern": "ME*"})


def test_an_unknown_model_type_lists_every_installed_converter(tmp_path):
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "rwkv7", "vocab_size": 8}))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(hf / "model.safetensors"))
    result = convert("import-hf", str(hf), str(tmp_path / "out"), exit_code=2)
    assert "model_type 'rwkv7' is read by no installed converter" in result.output
    for reader in ("gpt (plugtron-gpt", "llama", "hybrid (plugtron-gpt", "nemotron_h",
                   "mixtral (plugtron-moe", "deepseek_v3"):
        assert reader in result.output
    assert not (tmp_path / "out").exists()
