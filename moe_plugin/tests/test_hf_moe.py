"""Hugging Face interchange for MoE models (plugtron-moe's converters): tiny random Mixtral,
Qwen2-MoE and Qwen3-MoE models (one with YaRN rope) built from configs (no downloads). plugtron's logits equal transformers'
within 1e-5 (fp32); export after import gives back the same tensors, and importing that export
(transformers 5's fused expert tensors) gives back the same checkpoint."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors import safe_open

from tests.core.checkpoint.hf_models import (
    assert_exports_back,
    assert_same_checkpoint_tensors,
    convert,
    logits_of,
    save_random,
    tokens,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              initializer_range=0.2, num_experts_per_tok=2)


#: Qwen3-MoE's long-context rope (original context shrunk into the test's sequence).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}


def make_hf(kind: str, directory: str):
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                            rope_theta=5000.0, **COMMON)
        return save_random(transformers.MixtralForCausalLM, config, directory)
    if kind.startswith("qwen3_moe"):  # per-head q/k norms, no shared expert, no biases
        rope = {"rope_parameters": YARN} if kind.endswith("yarn") else {}
        config = transformers.Qwen3MoeConfig(
            intermediate_size=40, moe_intermediate_size=24, num_experts=4, head_dim=16,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], **rope, **COMMON)
        return save_random(transformers.Qwen3MoeForCausalLM, config, directory)
    config = transformers.Qwen2MoeConfig(
        intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=20,
        num_experts=4, norm_topk_prob=kind == "qwen2_moe-norm", decoder_sparse_step=1,
        mlp_only_layers=[0] if kind == "qwen2_moe" else [], **COMMON)
    return save_random(transformers.Qwen2MoeForCausalLM, config, directory)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen2_moe-norm", "qwen3_moe",
                                  "qwen3_moe-yarn"])
def test_import_gives_transformers_logits_and_exports_back(kind, tmp_path):
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model = make_hf(kind, hf_dir)
    result = convert("import-hf", hf_dir, ckpt)
    assert "--num-experts 4" in result.output
    assert ("--rope-type yarn" in result.output) == kind.endswith("yarn")

    batch = tokens(VOCAB, (2, SEQ))
    ours = logits_of(ckpt, batch, VOCAB)
    with torch.no_grad():
        theirs = model(batch).logits.float()
    assert theirs.std() > 0.1
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()

    assert_exports_back(model, ckpt, back)
    assert_fused_import_is_identical(ckpt, back, str(tmp_path / "again"))


def assert_fused_import_is_identical(ckpt: str, back: str, again: str):
    """The export writes transformers 5's fused expert tensors (``mlp.experts.gate_up_proj``,
    ``down_proj``), which transformers' own save_pretrained does not (it writes per-expert
    names): importing the export reads the fused layout, and gives the first import's
    checkpoint tensor for tensor, bit for bit."""
    names = set()
    for path in glob.glob(os.path.join(back, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names), sorted(names)
    assert not any(".experts.0." in n for n in names), sorted(names)
    convert("import-hf", back, again)
    assert_same_checkpoint_tensors(ckpt, again, VOCAB)
