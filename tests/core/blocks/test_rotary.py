"""The public rotary helpers (plugtron.api): partial rotary turns the first channels of each
head and passes the rest through, as Megatron-Core's ``--rotary-percent`` and GPT-NeoX's
``rotary_pct`` do; the GPT model's ``--rotary-percent`` uses it, and what cannot hold it is
refused before launch."""

from __future__ import annotations

import pytest
import torch
from plugtron.api import ConfigError, apply_rotary, rotary_freqs, rotary_freqs_at

from tests.utils import tiny_config


def _reference_partial(x, angles):
    """GPT-NeoX's partial rotary written out: rotate-half on the first ``r`` channels."""
    r = angles.shape[-1]
    turned, kept = x[..., :r], x[..., r:]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = turned.chunk(2, dim=-1)
    rotated = turned * cos + torch.cat([-second, first], dim=-1) * sin
    return torch.cat([rotated, kept], dim=-1)


def test_partial_rotary_turns_the_first_channels_and_keeps_the_rest():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 3, 16)
    angles = rotary_freqs(6, 4, 10000.0)  # a quarter of the head
    out = apply_rotary(x, angles)
    torch.testing.assert_close(out, _reference_partial(x, angles), rtol=0, atol=1e-6)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[:, 1:, :, :4], x[:, 1:, :, :4])  # position 0 is not turned


def test_partial_rotary_scores_depend_on_the_distance_only():
    """What rope is for: q.k of the turned channels is the same for every pair of positions
    the same distance apart."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 8, 1, 8), torch.randn(1, 1, 1, 8).expand(1, 8, 1, 8)
    angles = rotary_freqs_at(torch.arange(8)[None], 4, 10000.0)
    qr, kr = apply_rotary(q, angles), apply_rotary(k, angles)
    scores = (qr[0, :, 0] @ kr[0, :, 0].T)
    for distance in range(1, 4):
        diagonal = torch.diagonal(scores, offset=-distance)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), rtol=1e-5,
                                   atol=1e-5)


def test_angles_wider_than_the_head_are_refused():
    with pytest.raises(ValueError, match="rotary angles for 10 channels cannot turn a head of 8"):
        apply_rotary(torch.zeros(1, 2, 1, 8), rotary_freqs(2, 10, 10000.0))


@pytest.mark.parametrize("flags,message", [
    ({"rotary-percent": 0.1}, r"--rotary-percent 0.1: rope turns int\(8 x 0.1\) = 0 channels"),
    ({"rotary-percent": 1.5}, r"give a share in \(0, 1\]"),
    ({"rotary-percent": 0.5, "position-embedding-type": "learned_absolute"},
     "--rotary-percent needs --position-embedding-type rope"),
])
def test_bad_rotary_percent_is_refused_before_launch(flags, message):
    from plugtron.core.training.validate import validate

    config = tiny_config(**{"position-embedding-type": "rope", **flags})
    with pytest.raises(ConfigError, match=message):
        validate(config, world_size=1)


def test_the_gpt_model_turns_its_share_of_each_head():
    from plugtron_gpt.layers.attention_options import rotary_dim

    config = tiny_config(**{"position-embedding-type": "rope", "rotary-percent": 0.5})
    assert rotary_dim(config) == 4  # head 8 (hidden 32, 4 heads)
    assert config.model.hidden_size // config.model.num_attention_heads == 8


def test_hugging_face_export_refuses_partial_rotary():
    from plugtron_gpt.gpt.hf_families import family_of

    config = tiny_config(**{"position-embedding-type": "rope", "rotary-percent": 0.5})
    with pytest.raises(ConfigError, match="--rotary-percent 0.5: none of the Hugging Face "
                                          "families plugtron exports"):
        family_of(config)
