"""The output layer and its cross entropy in chunks of tokens (``--cross-entropy-loss-fusion``)
against torch's loss on the whole logits, in one process: several chunks, padded vocabulary rows,
label smoothing, bf16, and the weight's gradient deferred to a split backward's ``W``. The
tensor-parallel shards are in tests/distributed/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plugtron.core.blocks import linear_cross_entropy as lce
from plugtron.core.contracts import weight_grads as wgrad

VOCAB, PADDED, HIDDEN, TOKENS = 50, 64, 16, 1100  # 1100 tokens: three chunks of 512


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs it)"))]


def _inputs(dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, generator=gen).to(device, dtype)
    weight = (torch.randn(PADDED, HIDDEN, generator=gen) * 0.5).to(device, dtype)
    labels = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=gen).to(device)
    token_grads = torch.rand(2, TOKENS // 2, generator=gen).to(device)  # a loss mask's weights
    return hidden.requires_grad_(), weight.requires_grad_(), labels, token_grads


def _reference(hidden, weight, labels, token_grads, smoothing):
    logits = (hidden @ weight.t())[..., :VOCAB].float()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                           label_smoothing=smoothing).view_as(labels)
    (loss * token_grads).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def test_chunks_cover_the_tokens_with_at_least_the_minimum():
    assert lce.chunk_tokens(1100, 16, 50) == 512
    assert lce.chunk_tokens(100, 16, 50) == 100  # fewer tokens than a chunk: one chunk
    assert lce.chunk_tokens(8192, 4096, 32768) == 1024  # as many logits as hidden elements


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_torch_on_the_whole_logits(smoothing, device):
    hidden, weight, labels, token_grads = _inputs(device=device)
    want_loss, want_hidden, want_weight = _reference(hidden, weight, labels, token_grads,
                                                     smoothing)
    hidden.grad = weight.grad = None
    loss = lce.linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB,
                                    label_smoothing=smoothing)
    (loss * token_grads).sum().backward()
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, want_hidden, rtol=1e-5, atol=1e-6)
    # the weight's gradient sums 1100 tokens' products chunk by chunk: fp32 rounding of a sum
    torch.testing.assert_close(weight.grad, want_weight, rtol=1e-5, atol=1e-5)
    assert not weight.grad[VOCAB:].any()  # padded rows take no part


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_as_close_to_fp64_as_torchs_bf16_path(device):
    """bf16 hidden states and weight: gradients in bf16, the loss in fp32, each as close to the
    fp64 computation as torch's loss on bf16 logits is (within a factor 2 of its error, relative
    to the largest entry)."""
    hidden, weight, labels, token_grads = _inputs(torch.bfloat16, device=device)
    torch_loss, torch_hidden, torch_weight = (t.clone() for t in _reference(
        hidden, weight, labels, token_grads, 0.0))
    hidden.grad = weight.grad = None
    loss = lce.linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB)
    (loss * token_grads).sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    truth = _reference(*exact, labels, token_grads.double(), 0.0)
    for ours, theirs, want in zip((loss, hidden.grad, weight.grad),
                                  (torch_loss, torch_hidden, torch_weight), truth):
        scale = want.abs().max().item()
        ours_err = (ours.double() - want).abs().max().item() / scale
        theirs_err = (theirs.double() - want).abs().max().item() / scale
        assert ours_err <= 2 * theirs_err + 1e-3, (ours_err, theirs_err)


def test_no_gradient_asked_computes_the_loss_alone():
    hidden, weight, labels, _ = _inputs()
    with torch.no_grad():
        loss = lce.linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB)
        want = F.cross_entropy((hidden @ weight.t())[..., :VOCAB].flatten(0, 1),
                               labels.flatten(), reduction="none").view_as(labels)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)


def test_weight_gradient_deferred_to_w_is_the_same_bitwise():
    hidden, weight, labels, token_grads = _inputs()
    loss = lce.linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB)
    (loss * token_grads).sum().backward()
    combined = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    with wgrad.expecting_split_backward():
        loss = lce.linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB)
    store = wgrad.WeightGradStore()
    with wgrad.collecting_weight_grads(store):  # I: the input's gradient only
        (loss * token_grads).sum().backward()
    assert weight.grad is None and len(store) == 1
    assert torch.equal(hidden.grad, combined[0])
    store.run()  # W
    assert torch.equal(weight.grad, combined[1])


def test_label_smoothing_out_of_range_is_refused():
    hidden, weight, labels, _ = _inputs()
    with pytest.raises(ValueError, match="label smoothing"):
        lce.linear_cross_entropy(hidden, weight, labels, vocab_size=VOCAB, label_smoothing=1.0)
