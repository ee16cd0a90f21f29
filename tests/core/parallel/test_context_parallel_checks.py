"""Context parallelism: what is refused before launch (exit 2) and how a batch is cut."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.blocks.layer_stack import ComposedLayer
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.context_parallel import (
    check_built_layers,
    check_context_parallel_layers,
    check_support,
    local_positions,
    split_context_parallel_batch,
)
from plugtron.core.training.validate import validate
from plugtron.plugins.extensions.console_log import ConsoleLog

from tests.utils import tiny_config

ARGS = ["train", "--data", "mock", "--num-layers", "2", "--hidden-size", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
        "--vocab-size", "64", "--no-progress", "--eval-interval", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--nproc-per-node", "4"]


def _refused(*flags):
    result = CliRunner().invoke(cli, [*ARGS, *flags], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    return result.output


def test_seq_length_must_split_into_2cp_chunks():
    assert "not divisible by 2 x --cp 4 = 8" in _refused("--cp", "4", "--seq-length", "20")


def test_sequence_parallel_needs_2_cp_tp():
    out = _refused("--cp", "2", "--tp", "2", "--sequence-parallel", "--seq-length", "12")
    assert "2 x --cp 2 x --tp 2 = 8" in out


def test_a2a_needs_heads_and_groups_divisible_by_cp():
    out = _refused("--cp", "4", "--seq-length", "16", "--cp-comm-type", "a2a",
                   "--num-attention-heads", "4", "--num-query-groups", "2")
    assert "a2a" in out and "divisible by --cp 4" in out


def test_attention_dropout_is_accepted_with_every_comm_type():
    for comm_type in ("p2p", "allgather", "a2a"):
        validate(tiny_config(cp=2, seq_length=16, attention_dropout=0.1,
                             cp_comm_type=comm_type), 2)


def test_a_valid_cp_config_passes():
    validate(tiny_config(cp=2, seq_length=16), 2)
    validate(tiny_config(cp=2, tp=2, sequence_parallel=True, seq_length=16,
                         cp_comm_type="a2a"), 4)


class _Undeclared:
    name = "plain"


def test_model_and_backend_must_declare_cp():
    config = tiny_config(cp=2)
    with pytest.raises(ConfigError, match="model 'plain' does not declare"):
        check_support(config, model=_Undeclared())
    with pytest.raises(ConfigError, match="layer backend 'plain' does not declare"):
        check_support(config, layer_backend=_Undeclared)
    check_support(tiny_config(), model=_Undeclared())  # cp 1: nothing to declare


class Mamba(torch.nn.Module):
    """A layer type written without cp in mind (a scan over the local tokens only)."""

    symbol = "M"

    def __init__(self):
        super().__init__()
        self.mixer = torch.nn.Linear(2, 2)


def test_a_layer_type_without_the_declaration_is_refused():
    with pytest.raises(ConfigError, match="layer type 'M'.*does not support context"):
        check_context_parallel_layers(tiny_config(cp=2), [Mamba])
    check_context_parallel_layers(tiny_config(), [Mamba])


def test_the_built_model_is_checked_too_inside_composed_layers():
    parallel = ParallelContext.build(2, 0, cp=2, create_groups=False)
    model = torch.nn.ModuleDict({"0": ComposedLayer([Mamba()])})
    with pytest.raises(ConfigError, match="layer type 'M'"):
        check_built_layers([model], parallel)


def test_split_keeps_chunks_r_and_2cp_minus_1_minus_r():
    seq, cp = 16, 4
    batch = {"tokens": torch.arange(seq).expand(2, seq), "labels": torch.arange(seq)[None] + 1,
             "attention_mask": torch.ones(2, 1, seq, seq), "note": "kept"}
    for rank in range(cp):
        local = split_context_parallel_batch(batch, seq, rank, cp)
        want = local_positions(seq, rank, cp)
        assert want.tolist() == [*range(2 * rank, 2 * rank + 2),
                                 *range(14 - 2 * rank, 16 - 2 * rank)]
        assert torch.equal(local["tokens"][0], want)
        assert torch.equal(local["labels"][0], want + 1)
        assert local["attention_mask"].shape == (2, 1, seq // cp, seq)
        assert local["note"] == "kept"


def test_the_console_header_names_cp_and_its_comm_type(capsys):
    state = type("State", (), {"iteration": 0})()
    ConsoleLog().plugtron_train_start(tiny_config(cp=2, seq_length=16, cp_comm_type="a2a"),
                                      state)
    assert "cp 2 (a2a)" in capsys.readouterr().out
    ConsoleLog().plugtron_train_start(tiny_config(), state)
    assert "cp 1;" in capsys.readouterr().out


def test_the_cli_refuses_cp_with_a_mamba_layer():
    out = _refused("--model", "hybrid", "--hybrid-layer-pattern", "M*", "--cp", "2",
                   "--seq-length", "16", "--mamba-state-dim", "8", "--mamba-head-dim", "8",
                   "--mamba-num-groups", "2", "--mamba-chunk-size", "4")
    assert "context parallelism is not supported with Mamba" in out


def test_moe_layers_run_under_cp_in_both_models():
    """E declares cp support: its router sums the balancing statistics over cp (trained against
    one process in moe_plugin/tests/test_moe_context_parallel.py). The check sees what is
    built: E in place of - once --num-experts is set, and E in a Hybrid pattern."""
    validate(tiny_config(cp=2, seq_length=16, num_experts=4), 2)
    validate(tiny_config(model="hybrid", hybrid_layer_pattern="*E", cp=2, seq_length=16,
                         num_experts=4), 2)
