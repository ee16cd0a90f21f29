"""GPT model options and loss masking (single process, local backend)."""

from __future__ import annotations

import math

import pytest
import torch
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.plugins import registry
from plugtron.core.training.loop import finalize_model_config
from plugtron.core.training.step_info import NonFiniteLossError

from tests.utils import tiny_config

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def build(**overrides):
    config = tiny_config(**overrides)
    parallel = ParallelContext.build(1, 0)
    finalize_model_config(config, parallel)
    backend = registry.load("layer_backend", "local")(config, parallel)
    gpt = registry.instantiate(registry.load("model", "gpt"))
    model = gpt.model_provider(config=config, pre_process=True, post_process=True,
                               vp_stage=None, layer_backend=backend, parallel=parallel)
    return config, model, gpt


def batch(config, n=2):
    g = torch.Generator().manual_seed(0)
    s = config.model.seq_length
    tokens = torch.randint(0, config.model.vocab_size, (n, s), generator=g)
    return tokens, torch.arange(s).expand(n, s), torch.randint(0, config.model.vocab_size, (n, s),
                                                                generator=g)


def names(model):
    return dict(model.named_parameters())


def test_default_layout_and_names():
    config, model, _ = build()
    params = names(model)
    assert "embedding.word_embeddings.weight" in params
    assert "embedding.position_embeddings.weight" in params
    assert QKV in params
    assert "decoder.layers.1.mlp.linear_fc2.bias" in params
    assert "decoder.final_layernorm.weight" in params
    assert "output_layer.weight" not in params  # tied by default
    assert isinstance(model.decoder.final_layernorm, torch.nn.LayerNorm)


def test_rope_removes_learned_positions_and_changes_output():
    config, model, _ = build(position_embedding_type="rope")
    assert "embedding.position_embeddings.weight" not in names(model)
    tokens, pos, labels = batch(config)
    out = model(tokens, pos, labels=labels)
    assert out.shape == tokens.shape and torch.isfinite(out).all()


def test_rmsnorm_swiglu_gqa_untied_no_bias():
    config, model, _ = build(normalization="RMSNorm", swiglu=True, num_query_groups=2,
                             untie_embeddings_and_output_weights=True, add_bias_linear=False,
                             ffn_hidden_size=48)
    params = names(model)
    assert not any(n.endswith(".bias") and "layernorm" not in n for n in params)
    assert params["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48, 32)
    head_dim = 32 // 4
    assert params[QKV].shape == ((4 + 2 * 2) * head_dim, 32)
    assert "output_layer.weight" in params
    assert not torch.equal(params["output_layer.weight"],
                           params["embedding.word_embeddings.weight"])
    assert type(model.decoder.final_layernorm).__name__ == "RMSNorm"
    tokens, pos, labels = batch(config)
    assert torch.isfinite(model(tokens, pos, labels=labels)).all()


def test_gqa_matches_mha_when_groups_repeat_the_keys():
    """GQA with one group equals MHA whose every head uses that group's keys and values."""
    config, model, _ = build(num_query_groups=1)
    tokens, pos, _ = batch(config)
    assert model(tokens, pos).shape[-1] == config.model.padded_vocab_size


def test_scaled_init_of_output_projections():
    config, model, _ = build(num_layers=8, hidden_size=64, ffn_hidden_size=256,
                             init_method_std=0.05)
    params = names(model)
    std_in = params[QKV].std().item()
    std_out = params["decoder.layers.0.mlp.linear_fc2.weight"].std().item()
    assert std_in == pytest.approx(0.05, rel=0.1)
    assert std_out == pytest.approx(0.05 / math.sqrt(16), rel=0.1)


def test_dropout_only_in_training_mode():
    config, model, _ = build(hidden_dropout=0.5, attention_dropout=0.5)
    tokens, pos, labels = batch(config)
    model.eval()
    a, b = model(tokens, pos, labels=labels), model(tokens, pos, labels=labels)
    assert torch.equal(a, b)
    model.train()
    c, d = model(tokens, pos, labels=labels), model(tokens, pos, labels=labels)
    assert not torch.equal(c, d)


def test_padded_vocabulary_never_wins_and_never_counts():
    config, model, _ = build()
    assert config.model.padded_vocab_size == 104 and config.model.vocab_size == 100
    tokens, pos, labels = batch(config)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[100:] = 50.0  # padded rows would dominate
    losses = model(tokens, pos, labels=labels)
    logits = model(tokens, pos)[..., :100]
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                  reduction="none").view_as(labels)
    assert torch.allclose(losses, reference, atol=1e-5)


def test_loss_masking():
    config, model, gpt = build()
    tokens, pos, labels = batch(config)
    mask = torch.ones_like(labels, dtype=torch.float32)
    mask[:, ::2] = 0
    losses = model(tokens, pos, labels=labels)
    loss_sum, num_tokens, report = gpt.loss_func(loss_mask=mask, output_tensor=losses)
    assert num_tokens.item() == mask.sum().item()
    assert torch.allclose(loss_sum, losses[:, 1::2].sum())
    # Changing labels at masked positions changes nothing.
    other = labels.clone()
    other[:, ::2] = (other[:, ::2] + 1) % 100
    loss2, _, _ = gpt.loss_func(loss_mask=mask, output_tensor=model(tokens, pos, labels=other))
    assert torch.allclose(loss_sum, loss2)


def test_nan_loss_names_iteration_and_rank():
    from plugtron.core.training import step_info

    _, _, gpt = build()
    step_info.current.iteration = 7
    with pytest.raises(NonFiniteLossError, match="iteration 7 on rank 0"):
        gpt.loss_func(loss_mask=torch.ones(1, 2), output_tensor=torch.tensor([[1.0, math.nan]]))
