"""YaRN rope (``--rope-type yarn``, issue 27): the frequencies and attention factor by hand on a
small case, equal to transformers' yarn initialiser (``modeling_rope_utils``) to the bit where it
is installed (skipped otherwise), and bad settings refused before launch (exit 2). The MLA
softmax-scale correction against transformers' DeepseekV3Attention is in test_mla.py; layouts
in test_mla_layouts.py."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.blocks.rotary import inv_frequencies, yarn_attention_factor, yarn_mscale
from plugtron.testing import make_config
from plugtron_gpt.layers.attention_options import rope_scaling
from plugtron_gpt.layers.mla import mla_scales


def _yarn(**options):
    flags = {"position-embedding-type": "rope", "rope-type": "yarn", **options}
    return rope_scaling(make_config(flags))


def test_frequencies_and_factors_by_hand():
    """dim 8, base 10^4, original context 16, factor 4, betas 32/1: the beta_fast channel is
    8 ln(16 / (32 x 2 pi)) / (2 ln 10^4) = -1.10 -> 0, the beta_slow one 8 ln(16 / 2 pi) /
    (2 ln 10^4) = 0.41 -> 1; so pair 0 keeps its frequency 1 and pairs 1-3 (0.1, 0.01, 0.001)
    are divided by 4."""
    scaling = _yarn(**{"rotary-scaling-factor": 4.0,
                       "yarn-original-max-position-embeddings": 16})
    got = inv_frequencies(8, 10000.0, scaling)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.025, 0.0025, 0.00025]),
                               rtol=1e-6, atol=0)
    assert yarn_mscale(4.0) == pytest.approx(1.1386294361, rel=1e-9)  # 0.1 ln 4 + 1
    assert yarn_attention_factor(scaling) == pytest.approx(1.1386294361, rel=1e-9)  # / 1
    deepseek = _yarn(**{"rotary-scaling-factor": 40.0, "mscale": 1.0, "mscale-all-dim": 1.0})
    assert yarn_attention_factor(deepseek) == 1.0
    config = make_config({"position-embedding-type": "rope", "rope-type": "yarn",
                          "rotary-scaling-factor": 40.0, "mscale": 1.0, "mscale-all-dim": 1.0,
                          "multi-latent-attention": True})
    assert mla_scales(config) == (1.0, pytest.approx((0.1 * math.log(40) + 1) ** 2))
    no_truncation = _yarn(**{"rotary-scaling-factor": 4.0,
                             "yarn-original-max-position-embeddings": 16,
                             "yarn-correction-range-round-to-int": False})
    # ramp from 0 (clamped) to 0.4059: pair 0 kept, the rest interpolated
    torch.testing.assert_close(inv_frequencies(8, 10000.0, no_truncation), got)


@pytest.mark.parametrize("dim,base,yarn", [
    (64, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                   "mscale_all_dim": 1.0}),  # DeepSeek-V3
    (128, 1000000.0, {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen
    (16, 500.0, {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                 "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.5, "truncate": False}),
], ids=["deepseek-v3", "qwen", "odd"])
def test_equal_to_transformers_yarn(dim, base, yarn):
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig
    hf = LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim,
                     max_position_embeddings=4 * yarn["original_max_position_embeddings"],
                     rope_parameters={"rope_type": "yarn", "rope_theta": base, **yarn})
    want, attention_factor = rope_utils._compute_yarn_parameters(hf, "cpu")
    flags = {"rotary-scaling-factor": yarn["factor"],
             "yarn-original-max-position-embeddings": yarn["original_max_position_embeddings"],
             "mscale": yarn.get("mscale", 1.0), "mscale-all-dim": yarn.get("mscale_all_dim", 0.0),
             "yarn-beta-fast": float(yarn.get("beta_fast", 32)),
             "yarn-beta-slow": float(yarn.get("beta_slow", 1)),
             "yarn-correction-range-round-to-int": yarn.get("truncate", True)}
    scaling = _yarn(**flags)
    assert torch.equal(inv_frequencies(dim, base, scaling), want)
    assert yarn_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)


TINY = ["--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters", "1",
        "--no-progress", "--eval-interval", "0"]
ROPE = ["--position-embedding-type", "rope"]


@pytest.mark.parametrize("args,message", [
    (["--rope-type", "yarn"], "it needs --position-embedding-type rope"),
    ([*ROPE, "--rotary-scaling-factor", "4"], "--rotary-scaling-factor only apply to --rope-type yarn"),
    ([*ROPE, "--mscale-all-dim", "1"], "--mscale-all-dim only apply to --rope-type yarn"),
    ([*ROPE, "--rope-type", "yarn", "--rotary-scaling-factor", "0"],
     "--rotary-scaling-factor must be positive"),
    ([*ROPE, "--rope-type", "yarn", "--yarn-beta-slow", "40"],
     "must be positive and below --yarn-beta-fast"),
    ([*ROPE, "--rope-type", "yarn", "--use-rope-scaling"], "two rotary scalings; choose one"),
    ([*ROPE, "--rope-type", "yarn", "--yarn-original-max-position-embeddings", "0"],
     "--yarn-original-max-position-embeddings must be at least 1"),
])
def test_bad_settings_exit_2_before_launch(args, message):
    result = CliRunner().invoke(cli, ["train", *TINY, *args], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
