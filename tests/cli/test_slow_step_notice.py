"""A run whose steps will take long on this CPU says so before it starts (gpt2-124m's first
step of minutes on 2 cores looked like a hang); a quick one says nothing."""

from __future__ import annotations

from types import SimpleNamespace

from plugtron.cli import preflight

from tests.utils import tiny_config


def _estimate(parameters: int):
    return SimpleNamespace(peak=SimpleNamespace(parameters=parameters))


def test_the_flops_of_a_step():
    config = tiny_config(num_layers=2, hidden_size=32, seq_length=16, global_batch_size=8)
    tokens = 8 * 16
    want = (6.0 * 1000 + 12.0 * 2 * 32 * 16) * tokens
    assert preflight.step_flops(config, _estimate(1000), 1) == want
    # dp 2 halves a rank's tokens
    assert preflight.step_flops(config, _estimate(1000), 2) == want / 2


def test_a_slow_step_is_announced_and_a_quick_one_is_not(monkeypatch, capsys):
    config = tiny_config(train_iters=100)
    monkeypatch.setattr(preflight, "cpu_matmul_flops", lambda threads: 2e9)
    flops = preflight.step_flops(config, _estimate(10**9), 1)
    preflight.announce_slow_steps(config, _estimate(10**9), 1, 1)
    err = capsys.readouterr().err
    seconds = flops / (2e9 * preflight.CPU_EFFICIENCY)
    assert seconds > preflight.SLOW_STEP_S
    assert "plugtron: expect about" in err and "per step on this CPU" in err
    assert "--train-iters 100" in err
    preflight.announce_slow_steps(config, _estimate(1000), 1, 1)
    assert capsys.readouterr().err == ""
