"""Multi-token prediction (``--mtp-num-layers``, issue 27) on one process: Megatron-Core's
parameter names; the losses and every parameter's gradient equal an objective written out here
(main loss sum + tokens x factor / D x each depth's masked mean, tokens shifted left and the
vacated places masked), within 1e-5 relative; each depth's loss reported unscaled under
``mtp_k loss``; bad settings refused before launch. Layouts: test_mtp_layouts.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.blocks.rotary import rotary_freqs
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training import aux_losses
from plugtron.core.training.loop import setup
from plugtron.testing import make_config

FLAGS = {"num-layers": 2, "mtp-num-layers": 2, "mtp-loss-scaling-factor": 0.3,
         "position-embedding-type": "rope", "normalization": "RMSNorm", "swiglu": True,
         "add-bias-linear": False}


def _model(flags=FLAGS):
    return setup(make_config(flags), world=single_process()).model_chunks[0].module


def test_parameter_names_are_megatron_cores():
    names = {n for n, _ in _model().named_parameters() if n.startswith("mtp.")}
    for k in (0, 1):
        for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
                     "mtp_model_layer.input_layernorm.weight",
                     "mtp_model_layer.self_attention.linear_qkv.weight",
                     "mtp_model_layer.mlp.linear_fc1.weight"):
            assert f"mtp.layers.{k}.{part}" in names, part
    model = _model()
    assert tuple(model.mtp.layers[0].eh_proj.weight.shape) == (32, 64)


def _rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _shift(t):
    return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)


@pytest.mark.parametrize("fused", [False, True], ids=["", "fused-loss"])
def test_losses_and_gradients_equal_the_written_out_objective(fused):
    # --cross-entropy-loss-fusion: each depth's output layer and loss in chunks, the same sums
    model = _model({**FLAGS, "cross-entropy-loss-fusion": fused})
    params = [p for _, p in model.named_parameters()]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16), generator=g)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    positions = torch.arange(16).expand(2, 16)
    aux_losses.take()
    aux_losses.set_loss_scale(1.0)  # an earlier fp16 run in this process may have left its own
    aux_losses.note_microbatch({"loss_mask": mask})
    out = model(tokens, positions, labels=labels, loss_mask=mask)
    got = torch.autograd.grad((out * mask).sum(), params)
    reported = aux_losses.take()

    weight = model.embedding.word_embeddings.weight  # tied: also the output layer
    rotary = rotary_freqs(16, 8, 10000.0)
    hidden = model.decoder(weight[tokens], rotary)

    def token_losses(h, target):
        return F.cross_entropy((h @ weight.T).flatten(0, 1), target.flatten(),
                               reduction="none").view_as(target)

    objective = (token_losses(hidden, labels) * mask).sum()
    n = mask.sum()
    means = []
    t, lab, m = tokens, labels, mask
    for layer in model.mtp.layers:
        t, lab, m = _shift(t), _shift(lab), _shift(m)
        x = torch.cat([_rms(weight[t], layer.enorm.weight),
                       _rms(hidden, layer.hnorm.weight)], -1) @ layer.eh_proj.weight.T
        hidden = _rms(layer.mtp_model_layer(x, rotary), layer.final_layernorm.weight)
        means.append((token_losses(hidden, lab) * m).sum() / m.sum())
        objective = objective + n * 0.3 / 2 * means[-1]
    want = torch.autograd.grad(objective, params)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    for k, mean in enumerate(means, start=1):  # reported unscaled: n x mean, as the main loss
        assert reported[f"mtp_{k} loss"].item() == pytest.approx((n * mean).item(), rel=1e-5)


def test_without_a_loss_mask_or_labels_no_mtp_loss_is_added():
    model = _model()
    aux_losses.take()
    tokens = torch.zeros(1, 16, dtype=torch.long)
    model(tokens)  # logits: generation and evaluation by logits
    model(tokens, labels=tokens)
    assert aux_losses.take() == {}


TINY = ["--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters", "1",
        "--no-progress", "--eval-interval", "0"]


@pytest.mark.parametrize("args,message", [
    (["--mtp-num-layers", "0", "--position-embedding-type", "rope"],
     "--mtp-num-layers must be at least 1"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers needs --position-embedding-type rope"),
    (["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--mtp-loss-scaling-factor",
      "-1"], "--mtp-loss-scaling-factor must be at least 0"),
])
def test_bad_settings_exit_2_before_launch(args, message):
    result = CliRunner().invoke(cli, ["train", *TINY, *args], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
