"""Hugging Face interchange for MoE models (plugtron-moe's converters): tiny random Mixtral,
Qwen2-MoE and Qwen3-MoE models built from configs (no downloads). plugtron's logits equal transformers'
within 1e-5 (fp32); export after import gives back the same tensors."""

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

VOCAB, SEQ = 100, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              initializer_range=0.2, num_experts_per_tok=2)


def make_hf(kind: str, directory: str):
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                            rope_theta=5000.0, **COMMON)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3_moe":  # per-head q/k norms, no shared expert, no biases
        config = transformers.Qwen3MoeConfig(
            intermediate_size=40, moe_intermediate_size=24, num_experts=4, head_dim=16,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], **COMMON)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=20,
            num_experts=4, norm_topk_prob=kind == "qwen2_moe-norm", decoder_sparse_step=1,
            mlp_only_layers=[0] if kind == "qwen2_moe" else [], **COMMON)
        model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # norms and biases away from 1 and 0, so mix-ups show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.eval()
    model.save_pretrained(directory)
    return model


def run_for(path: str):
    config = config_from_dict(CheckpointReader(path).config)
    apply_values(config, {"data": "mock", "seq_length": SEQ, "micro_batch_size": 2,
                          "global_batch_size": 2, "train_iters": 1, "progress": False,
                          "hidden_dropout": 0.0}, "test")
    config.model.padded_vocab_size = None
    run = setup(config, world=single_process())
    load_checkpoint(run, path, model_only=True)
    return run


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen2_moe-norm", "qwen3_moe"])
def test_import_gives_transformers_logits_and_exports_back(kind, tmp_path):
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model = make_hf(kind, hf_dir)
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", "import-hf", hf_dir, ckpt])
    assert result.exit_code == 0, result.output
    assert "--num-experts 4" in result.output

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    chunk = run_for(ckpt).model_chunks[0]
    chunk.eval()
    with torch.no_grad():
        ours = chunk(tokens)[..., :VOCAB].float()
        theirs = model(tokens).logits.float()
    assert theirs.std() > 0.1
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()

    result = runner.invoke(cli, ["convert", "export-hf", ckpt, back])
    assert result.exit_code == 0, result.output
    original = model.state_dict()
    reloaded = type(model).from_pretrained(back).state_dict()
    assert set(reloaded) == set(original)
    for name, value in original.items():
        assert torch.equal(reloaded[name], value), name
