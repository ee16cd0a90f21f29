"""The GPT model's architecture options of issue 15 on one process: bad values exit 2 before
launch; the sliding window equals attention with an explicit mask (also past the window); the
parameters --qk-layernorm and --add-qkv-bias add have Megatron-Core's names and shapes."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup
from plugtron.testing import make_config

TINY = ["--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters", "1",
        "--no-progress", "--eval-interval", "0"]
ROPE = ["--position-embedding-type", "rope"]


@pytest.mark.parametrize("args,message", [
    (["--window-size", "abc"], "--window-size 'abc': expected LEFT or LEFT,0"),
    (["--window-size", "4,2"], "RIGHT must be 0"),
    (["--window-size", "-3"], "LEFT must be at least 0"),
    (["--window-size", "4", "--nproc-per-node", "2", "--cp", "2", "--attention-dropout", "0"],
     "--window-size 4 shorter than --seq-length 64 with --context-parallel-size > 1"),
    (["--use-rope-scaling"], "need --position-embedding-type rope"),
    ([*ROPE, "--use-rope-scaling", "--rope-scaling-factor", "0"],
     "--rope-scaling-factor must be positive"),
    ([*ROPE, "--use-rope-scaling", "--rope-scaling-low-freq-factor", "4"],
     "must be positive and below --rope-scaling-high-freq-factor"),
    ([*ROPE, "--use-rope-scaling", "--rope-scaling-original-max-position-embeddings", "0"],
     "--rope-scaling-original-max-position-embeddings must be at least 1"),
    ([*ROPE, "--rotary-seq-len-interpolation-factor", "-1"],
     "--rotary-seq-len-interpolation-factor must be positive"),
    ([*ROPE, "--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "2"],
     "two rotary scalings; choose one"),
    (["--openai-gelu", "--swiglu"], "--openai-gelu is an approximation of GeLU"),
])
def test_bad_values_exit_2_before_launch(args, message):
    result = CliRunner().invoke(cli, ["train", *TINY, *args], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def _reference_window_attention(q, k, v, left):
    """softmax(q k^T / sqrt(d) + mask) v with the window written out, per head."""
    s, d = q.shape[1], q.shape[-1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    scores = scores.masked_fill(~((j <= i) & (i - j <= left)), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(q.shape[0], s, -1)


def _model(flags: dict):
    run = setup(make_config({"num-layers": 1, **flags}), world=single_process())
    return run.model_chunks[0].module


@pytest.mark.parametrize("left", [0, 3, 40])
def test_window_equals_an_explicit_mask_past_the_window(left):
    """Sequence 12: the window is shorter (0, 3), or longer than the sequence (40: causal)."""
    attention = _model({"window-size": f"{left},0"}).decoder.layers["0"].self_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 4, 8, generator=g) for _ in range(3))
    got = attention.core_attention.eval()(q, k, v)
    torch.testing.assert_close(got, _reference_window_attention(q, k, v, left),
                               atol=1e-6, rtol=0)


def test_qk_layernorm_and_qkv_bias_parameters():
    model = _model({"qk-layernorm": True, "add-qkv-bias": True, "add-bias-linear": False,
                    "normalization": "RMSNorm", "kv-channels": 8})
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    prefix = "decoder.layers.0.self_attention"
    assert shapes[f"{prefix}.q_layernorm.weight"] == (8,)
    assert shapes[f"{prefix}.k_layernorm.weight"] == (8,)
    assert shapes[f"{prefix}.linear_qkv.bias"] == (3 * 4 * 8,)
    assert f"{prefix}.linear_proj.bias" not in shapes
    assert "decoder.layers.0.mlp.linear_fc1.bias" not in shapes


def test_openai_gelu_is_the_tanh_approximation():
    mlp = _model({"openai-gelu": True}).decoder.layers["0"].mlp
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(1))
    h = torch.nn.functional.linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    tanh = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    expected = torch.nn.functional.linear(tanh, mlp.linear_fc2.weight, mlp.linear_fc2.bias)
    torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=0)
    assert not torch.allclose(torch.nn.functional.gelu(h), tanh, atol=1e-6)


def test_rope_settings_in_either_config_json_spelling():
    """transformers 5 writes ``rope_parameters``; older files carry ``rope_scaling`` with
    ``type`` or ``rope_type`` and a top-level ``rope_theta``: both read the same."""
    from plugtron_gpt.gpt.hf_families import rope_flags

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    new = rope_flags({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
    old = rope_flags({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}})
    assert new == old and new["use-rope-scaling"] and new["rotary-base"] == 5e5
    assert rope_flags({"rope_scaling": {"rope_type": "linear", "factor": 2}}) == {
        "rotary-base": 10000.0, "rotary-seq-len-interpolation-factor": 2.0}
    with pytest.raises(Exception, match="'longrope'"):
        rope_flags({"rope_scaling": {"rope_type": "longrope", "factor": 2}})
