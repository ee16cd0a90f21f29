"""--reset-attention-mask: packed documents attend only within themselves. A packed sample of
two documents gives exactly the logits of the two documents run separately (fp32, 1e-6); what
cannot mask documents (context parallelism, the te backend) is refused before launch."""

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


@pytest.mark.parametrize("lengths", [(70, 1, 185), (100, 156), (9, 3, 17, 40, 1, 9, 30, 12)])
@pytest.mark.parametrize("heads,groups,v_dim", [(4, 4, 8), (4, 2, 8), (4, 4, 6)])
def test_documents_alone_equal_one_masked_kernel_and_keep_what_flash_keeps(
        monkeypatch, lengths, heads, groups, v_dim):
    """fp32 on CPU: each document's flash attention alone (document_attention.py; documents of
    similar length batched, zero-padded) gives the masked kernel's output and gradients (a
    one-token document between long ones; short documents sharing a padded batch; the second
    row's documents differ; grouped queries; values narrower than the keys, as MLA's), and keeps
    for backward what causal flash keeps."""
    import contextlib

    from plugtron.api import forward_context
    from plugtron.plugins.layer_backends import document_attention, local
    from plugtron.testing import saved_activation_bytes

    gen = torch.Generator().manual_seed(3)
    s = sum(lengths)
    q = torch.randn(2, s, heads, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, s, groups, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, s, groups, v_dim, generator=gen, requires_grad=True)
    grad = torch.randn(2, s, heads * v_dim, generator=gen)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
                       torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([s // 2,
                                                                                   s - s // 2]))])
    attention = local.CoreAttention(heads, groups, 8, 0.0, contextlib.nullcontext)
    calls = []
    real = document_attention.per_document_attention
    monkeypatch.setattr(document_attention, "per_document_attention",
                        lambda *args: calls.append(1) or real(*args))
    results = []
    applies = document_attention.applies
    for alone in (True, False):  # each document alone; one masked kernel
        monkeypatch.setattr(document_attention, "applies",
                            applies if alone else (lambda *args: False))
        with forward_context(document_ids=ids):
            out = attention(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    assert len(calls) == 1  # the first pass took the per-document path, the second did not
    for got, want, name in zip(*results, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    monkeypatch.setattr(document_attention, "applies", applies)
    with forward_context(document_ids=ids):
        alone = saved_activation_bytes(attention, q, k, v)
    causal = saved_activation_bytes(attention, q, k, v)
    assert alone <= causal, (alone, causal)


def test_documents_alone_with_dropout_keep_documents_apart_and_equal_flash_without():
    """With attention dropout each document runs alone too (padded batches through torch's
    attention): at p 0 it gives the flash path's result; at p 0.3 a document's output does not
    move when another document's values do (same seed), and it is not the undropped output."""
    from plugtron.plugins.layer_backends import document_attention as da

    gen = torch.Generator().manual_seed(4)
    lengths = [150, 7, 30, 1, 69]
    runs = [[(sum(lengths[:i]), sum(lengths[:i + 1])) for i in range(len(lengths))]]
    s = sum(lengths)
    q = torch.randn(1, 4, s, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, s, 8, generator=gen, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, 4, s, 8, generator=gen)
    flash = da.per_document_attention(q, k, v, runs)
    plain = da.per_document_dropout_attention(q, k, v, runs, 0.0)
    torch.testing.assert_close(plain, flash, rtol=1e-5, atol=1e-6)
    want = torch.autograd.grad(flash, (q, k, v), grad)
    got = torch.autograd.grad(plain, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.manual_seed(9)
    dropped = da.per_document_dropout_attention(q, k, v, runs, 0.3)
    other = v.detach().clone()
    other[:, :, 150:] += 1.0  # every document but the first
    torch.manual_seed(9)
    moved = da.per_document_dropout_attention(q, k, other, runs, 0.3)
    assert torch.equal(dropped[:, :, :150], moved[:, :, :150])
    assert not torch.allclose(dropped[:, :, 150:], moved[:, :, 150:])
    assert not torch.allclose(dropped, flash)


@pytest.mark.parametrize("fp32_kernel", [True, False])
def test_documents_alone_in_bf16_equal_the_masked_kernel(monkeypatch, fp32_kernel):
    """bf16 takes the per-document path too, natively (AMX) or through fp32 copies (a CPU
    without bf16 matrix instructions): the masked kernel's result within bf16's rounding."""
    import contextlib

    from plugtron.api import forward_context
    from plugtron.plugins.layer_backends import document_attention, local

    monkeypatch.setattr(local, "_fp32_on_cpu", lambda dtype: fp32_kernel)
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([150, 7, 30, 69])
    s = int(lengths.sum())
    q, k, v = (torch.randn(1, s, 4, 8, generator=gen).bfloat16().requires_grad_()
               for _ in range(3))
    grad = torch.randn(1, s, 32, generator=gen).bfloat16()
    ids = torch.repeat_interleave(torch.arange(4), lengths)[None]
    attention = local.CoreAttention(4, 4, 8, 0.0, contextlib.nullcontext)
    applies = document_attention.applies
    results = []
    for alone in (True, False):
        monkeypatch.setattr(document_attention, "applies",
                            applies if alone else (lambda *args: False))
        with forward_context(document_ids=ids):
            out = attention(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for got, want, name in zip(*results, ("out", "dq", "dk", "dv")):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=name)


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


def test_a_backend_that_cannot_mask_documents_is_refused_with_exit_2(monkeypatch):
    from plugtron.core.training.validate import validate
    from plugtron.plugins.layer_backends.te import TEBackend

    monkeypatch.setattr(TEBackend, "supports_document_ids", False)  # te masks them (THD)

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
