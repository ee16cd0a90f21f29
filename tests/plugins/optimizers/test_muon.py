"""``--optimizer muon`` on one process: the step equals torch.optim.Muon with torch's AdamW for
the other parameters, fused projections are orthogonalized per part, a tiny GPT learns with
it, and what it cannot do is refused before launch (exit 2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from plugtron.api import CheckpointError, mark_fused_parts
from plugtron.cli.main import cli
from plugtron.core.checkpoint import load_if_requested
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup
from plugtron.plugins.optimizers.muon import make_muon, muon_groups
from plugtron.plugins.optimizers.muon_matrices import Orthogonalizer
from plugtron.plugins.optimizers.newton_schulz import newton_schulz, scale_factor, schedule

from tests.utils import tiny_config, train_in_process

#: One rank, no tensor parallelism: what Orthogonalizer reads of a ParallelContext.
ONE_RANK = SimpleNamespace(tp_group=None, tp_rank=0, tp_size=1, etp_group=None, etp_rank=0,
                           etp_size=1)


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8, 24), (32, 8), (16,)]  # two hidden matrices, an embedding, a bias
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    params[2].is_embedding_or_output_parameter = True
    return params


@pytest.mark.parametrize("flags,torch_muon", [
    ({"muon_scale_mode": "spectral", "muon_extra_scale_factor": 0.2, "muon_nesterov": True},
     {"adjust_lr_fn": "match_rms_adamw", "nesterov": True}),
    ({"muon_scale_mode": "shape_scaling", "muon_momentum": 0.9},
     {"adjust_lr_fn": "original", "nesterov": False, "momentum": 0.9}),
], ids=["match-rms-adamw-nesterov", "original"])
def test_steps_like_torch_muon_with_adamw(flags, torch_muon):
    config = tiny_config(optimizer="muon", muon_coefficient_type="simple", lr=0.02,
                         weight_decay=0.1, **flags)
    ours, theirs = _params(0), _params(0)
    named = [(f"p{i}" if i != 3 else "p.bias", p) for i, p in enumerate(ours)]
    optimizer = make_muon(config, ONE_RANK)(muon_groups(0.1)(named))
    reference = [torch.optim.Muon(theirs[:2], lr=0.02, weight_decay=0.1, **torch_muon),
                 torch.optim.AdamW([{"params": [theirs[2]], "weight_decay": 0.1},
                                    {"params": [theirs[3]], "weight_decay": 0.0}],
                                   lr=0.02, betas=(0.9, 0.95), eps=1e-8)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        optimizer.step()
        for torch_optimizer in reference:
            torch_optimizer.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_fused_qkv_is_orthogonalized_per_part():
    config = tiny_config(optimizer="muon", muon_fp32_matmul_prec="high")
    groups, q, kv, hidden = 2, 4, 2, 6  # per query group: 4 query rows, 2 key, 2 value
    weight = torch.nn.Parameter(torch.zeros(groups * (q + 2 * kv), hidden))
    mark_fused_parts(weight, (q, kv, kv), groups=groups, kind="qkv")
    update = torch.randn(weight.shape, generator=torch.Generator().manual_seed(2))
    got = Orthogonalizer(config.muon, ONE_RANK)(weight, update)
    per_group = update.view(groups, q + 2 * kv, hidden)
    coefficients = schedule("quintic", 5)
    for lo, hi in ((0, q), (q, q + kv), (q + kv, q + 2 * kv)):
        part = per_group[:, lo:hi].reshape(-1, hidden)
        want = newton_schulz(part, coefficients, torch.float32) * \
            scale_factor(part.size(0), hidden, "spectral")
        torch.testing.assert_close(got.view(groups, -1, hidden)[:, lo:hi].reshape(-1, hidden),
                                   want)
    whole = Orthogonalizer(tiny_config(optimizer="muon", muon_fp32_matmul_prec="high",
                                       muon_split_qkv=False).muon, ONE_RANK)(weight, update)
    assert not torch.allclose(whole, got)


#: Measured: 4.62 -> 3.89 over 60 iterations (AdamW at the same lr: 4.62 -> 3.92).
LEARNS = {"optimizer": "muon", "lr": 3e-3, "muon_extra_scale_factor": 0.2, "train_iters": 40,
          "hidden_size": 64, "seq_length": 32, "micro_batch_size": 4, "lr_warmup_iters": 10,
          "min_lr": 3e-4}


def test_the_iteration_runs_under_the_flag_s_matmul_precision(monkeypatch):
    """``--muon-fp32-matmul-prec`` is torch's float32 matmul precision around the iteration
    (Megatron-Core's), restored after; on this CPU ``high`` and ``highest`` compute alike."""
    seen = []
    set_precision = torch.set_float32_matmul_precision
    monkeypatch.setattr(torch, "set_float32_matmul_precision",
                        lambda p: seen.append(p) or set_precision(p))
    before = torch.get_float32_matmul_precision()
    matrix, update = _params(0)[0], torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    for precision in ("medium", "high", "highest"):
        config = tiny_config(optimizer="muon", muon_fp32_matmul_prec=precision)
        out[precision] = Orthogonalizer(config.muon, ONE_RANK)(matrix, update)
        assert seen[-2:] == [precision, before]
    assert torch.get_float32_matmul_precision() == before
    assert torch.equal(out["high"], out["highest"])
    assert not torch.equal(out["medium"], out["high"])  # the bf16 iteration


def test_a_tiny_gpt_learns_with_muon():
    records, run = train_in_process(tiny_config(**LEARNS), world=single_process())
    losses = [r["lm_loss"] for r in records]
    assert losses[-1] < losses[0] - 0.4, losses
    # the matrices are Muon's (learned position embeddings too, as in Megatron-Core); the word
    # embedding (tied output layer), norms and biases AdamW's
    muon, = [g for g in run.optimizer.param_groups if g.get("muon")]
    want = [p for n, p in run.model_chunks[0].named_parameters()
            if p.ndim == 2 and "word_embeddings" not in n and "output_layer" not in n]
    assert [id(p) for p in muon["params"]] == [id(p) for p in want]


@pytest.mark.parametrize("flags,message", [
    (["--sgd-momentum", "0.5"], "--sgd-momentum"),
    (["--fp16"], "--optimizer muon with --fp16"),
    (["--muon-num-ns-steps", "4"], "quintic needs a multiple of 5 steps"),
    (["--use-torch-fsdp2", "--use-distributed-optimizer", "--nproc-per-node", "2"],
     "already shards the state"),
])
def test_refusals_exit_2(flags, message):
    result = CliRunner().invoke(cli, ["train", "--optimizer", "muon", "--data", "mock",
                                      "--train-iters", "1", *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_an_optimizer_without_a_sharded_mode_is_refused_with_the_distributed_flag():
    result = CliRunner().invoke(cli, ["train", "--optimizer", "sgd", "--data", "mock",
                                      "--use-distributed-optimizer", "--train-iters", "1"])
    assert result.exit_code == 2 and "does not offer" in result.output, result.output


def test_a_resume_that_switches_optimizer_is_refused(tmp_path):
    train_in_process(tiny_config(train_iters=1, save=str(tmp_path), save_interval=1),
                     world=single_process())
    run = setup(tiny_config(optimizer="muon", train_iters=2, load=str(tmp_path)),
                world=single_process())
    with pytest.raises(CheckpointError, match="momentum_buffer|exp_avg"):
        load_if_requested(run)


def test_the_estimate_counts_the_layer_wise_state_split():
    from plugtron.api import estimate_memory

    whole = estimate_memory(tiny_config(optimizer="muon"), 2).ranks[0]
    estimate = estimate_memory(tiny_config(optimizer="muon", use_distributed_optimizer=True), 2)
    split = estimate.ranks[0]
    # the fullest of the two ranks (whole parameters do not halve exactly), and the buffers
    # the stepped parameters are all-gathered into
    assert whole.optimizer_selected / 2 <= split.optimizer_selected < whole.optimizer_selected
    assert whole.gathered_bytes == 0 < split.gathered_bytes
    assert any("layer-wise" in note for note in estimate.notes)
