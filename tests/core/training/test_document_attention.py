"""--reset-attention-mask: packed documents attend only within themselves. A packed sample of
two documents gives exactly the logits of the two documents run separately (fp32, 1e-6), by
the masked kernel and by the per-document path; what cannot mask documents (the te backend) is
refused before launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from plugtron.api import SampleOptions, sample_from_window
from plugtron.cli.main import cli
from plugtron.plugins.layer_backends.attention_mask import causal_mask

from gpt_plugin.tests.test_gpt_model import build

EOD = 99


def test_causal_mask_alone_and_with_documents():
    assert torch.equal(causal_mask(3, 3)[0, 0], torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    # the last query of a generation step sees every key
    assert causal_mask(1, 4)[0, 0].tolist() == [[True] * 4]
    ids = torch.tensor([[0, 0, 1, 1]])
    assert causal_mask(4, 4, ids)[0, 0].int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


@pytest.mark.parametrize("lengths", [(70, 1, 185), (100, 156), (20, 30, 206)])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_the_cpu_document_paths_equal_one_masked_kernel(lengths, heads, groups):
    """On CPU packed documents take a kernel call per document (64 tokens or more on average)
    or, for many short ones, tiles of queries against the keys back to their document's start
    (here 48 rows a tile, so documents cross tiles). Both give the masked kernel's output and
    gradients: a one-token document between long ones; the second row's documents differ."""
    import contextlib

    from plugtron.api import forward_context
    from plugtron.plugins.layer_backends import local

    gen = torch.Generator().manual_seed(3)
    s = sum(lengths)
    q = torch.randn(2, s, heads, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, s, groups, 8, generator=gen, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, s, heads * 8, generator=gen)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
                       torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([s // 2,
                                                                                   s - s // 2]))])
    mask = causal_mask(s, s, ids)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask, enable_gqa=heads != groups)
    want = want.transpose(1, 2).reshape(2, s, -1)
    want = (want, *torch.autograd.grad(want, (q, k, v), grad))
    attention = local.CoreAttention(heads, groups, 8, 0.0, contextlib.nullcontext)
    for floor in (1, 10 ** 9):  # a call per document; tiles
        kept = local.MIN_DOCUMENT_RUN, local.BAND_ROWS
        local.MIN_DOCUMENT_RUN, local.BAND_ROWS = floor, 48
        try:
            with forward_context(document_ids=ids):
                out = attention(q, k, v)
        finally:
            local.MIN_DOCUMENT_RUN, local.BAND_ROWS = kept
        got = (out, *torch.autograd.grad(out, (q, k, v), grad))
        for g, w, name in zip(got, want, ("out", "dq", "dk", "dv")):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{floor}: {name}")


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
def test_packed_documents_equal_the_documents_run_alone(positions):
    config, model, gpt = build(position_embedding_type=positions, seq_length=16)
    model.eval()
    g = torch.Generator().manual_seed(1)
    a = torch.cat([torch.randint(0, EOD, (5,), generator=g), torch.tensor([EOD])])
    b = torch.randint(0, EOD, (11,), generator=g)
    window = torch.cat([a, b])  # 17 tokens: a sample of 16 and its labels
    options = SampleOptions(reset_position_ids=True, reset_attention_mask=True)
    sample = sample_from_window(window.numpy(), options, EOD)
    assert sample["attention_mask"].tolist() == [0] * 6 + [1] * 10
    batch = {k: v[None] for k, v in sample.items()}
    with torch.no_grad():
        packed = model(batch["tokens"], batch["position_ids"],
                       document_ids=batch["attention_mask"])
        alone_a = model(a[None], torch.arange(6)[None])
        alone_b = model(b[None, :10], torch.arange(10)[None])
        unmasked = model(batch["tokens"], batch["position_ids"])
        # the plugin's forward_step hands the batch's attention_mask to the model
        losses, _ = gpt.forward_step(iter([batch]), model)
    torch.testing.assert_close(packed[:, :6], alone_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(packed[:, 6:], alone_b, atol=1e-6, rtol=0)
    assert (unmasked[:, 6:] - alone_b).abs().max() > 1e-3, "the mask must matter"
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(
            packed[0, :, :config.model.vocab_size], batch["labels"][0], reduction="none")
    torch.testing.assert_close(losses[0], expected, atol=1e-6, rtol=0)


def _train(*flags):
    args = ["train", "--data", "mock", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "1", "--vocab-size", "64",
            "--no-progress", "--eval-interval", "0", "--attention-dropout", "0",
            "--reset-attention-mask", *flags]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_te_backend_is_refused_with_exit_2():
    from plugtron.core.training.validate import validate

    from tests.utils import tiny_config

    config = tiny_config(reset_attention_mask=True, layer_backend="te")
    from plugtron.core.errors import ConfigError

    with pytest.raises(ConfigError, match="not supported by --layer-backend te"):
        validate(config, 1)
    result = _train("--layer-backend", "te")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_document_numbers_follow_megatrons_eod_rule():
    sample = sample_from_window(np.array([1, EOD, 2, 3, EOD, 4]),
                                SampleOptions(reset_attention_mask=True), EOD)
    assert sample["attention_mask"].tolist() == [0, 0, 1, 1, 1]
