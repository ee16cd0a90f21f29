"""The CLI: bad input exits 2 with a message before any rank starts; config files, presets,
plugins list, topology."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli

TINY = ["--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters", "2",
        "--no-progress", "--eval-interval", "0", "--hidden-dropout", "0"]


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "world size 1 is not divisible by tp 3"),
    (["--nproc-per-node", "2", "--tp", "4"], "world size 2 is not divisible by tp 4"),
    (["--num-attention-heads", "3"],
     "--hidden-size 64 is not divisible by --num-attention-heads 3"),
    (["--num-query-groups", "3"], "not divisible by --num-query-groups 3"),
    (["--global-batch-size", "6"], "must be a multiple of --micro-batch-size 4"),
    (["--schedule", "zigzag"], "unknown schedule 'zigzag'; available: 1f1b (plugtron"),
    (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--model", "bert"], "unknown model 'bert'; available: gpt (plugtron-gpt"),
    (["--model", "gtp"], "unknown model 'gtp' (did you mean 'gpt'?); available: gpt"),
    (["--schedule", "1fb1"], "unknown schedule '1fb1' (did you mean '1f1b'?)"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be at least 1"),
    (["--vp", "2"], "--vp needs --pp > 1"),
    (["--data-path", "/no/such/dir"], "--data-path '/no/such/dir' does not exist"),
    (["--lr-decay-style", "step"], "Invalid value for '--lr-decay-style'"),
    (["--num-layers", "x"], "'x' is not a valid integer"),
    (["-p", "logging"], "only '-p no:NAME'"),
])
def test_bad_input_exits_2_with_a_message(args, message):
    result = invoke(["train", *TINY, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.count("available:") <= 1  # the choices once, not in a warning too


def test_train_runs_and_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = invoke(["train", *TINY, "--metrics-file", str(metrics), "--eval-interval", "1",
                     "--eval-iters", "1"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_lines = [r for r in lines if "lm_loss" in r]
    assert [r["iteration"] for r in train_lines] == [1, 2]
    for key in ("grad_norm", "lr", "tokens_per_sec", "step_time_s", "consumed_samples"):
        assert key in train_lines[0]
    assert any("valid_lm_loss" in r for r in lines)
    assert lines[-1]["summary"] is True


def test_config_file_and_flags_override(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("num-layers: 3\nhidden_size: 48\nseq-length: 16\n")
    toml_file = tmp_path / "run.toml"
    toml_file.write_text("[model]\nnum_layers = 3\n")
    from plugtron.cli.options import build_config

    config = build_config({"model__num_layers": 1}, str(yaml_file), "tiny")
    assert config.model.num_layers == 1 and config.model.hidden_size == 48
    assert config.model.seq_length == 16 and config.training.train_iters == 20  # preset
    assert build_config({}, str(toml_file), None).model.num_layers == 3


def test_bad_config_file():
    result = invoke(["train", "--config", "/no/such.yaml"])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_unknown_config_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num-layer: 3\n")
    result = invoke(["train", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown setting 'num-layer'" in result.output


def test_plugins_list():
    result = invoke(["plugins", "list", "--check"])
    assert result.exit_code == 0, result.output
    assert "plugtron.schedules" in result.output
    assert "no-pipelining" in result.output and "ok" in result.output
    assert "gpt" in result.output and "plugtron-gpt" in result.output


def test_topology_world8_tp2_pp2():
    result = invoke(["topology", "--world-size", "8", "--tp", "2", "--pp", "2", "--json"])
    groups = json.loads(result.output)["groups"]
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    text = invoke(["topology", "--world-size", "8", "--tp", "2", "--cp", "2"]).output
    assert "[0, 2] [1, 3] [4, 6] [5, 7]" in text


def test_topology_bad_sizes():
    result = invoke(["topology", "--world-size", "6", "--tp", "4"])
    assert result.exit_code == 2 and "not divisible" in result.output


def test_an_option_of_an_unselected_plugin_names_its_owner():
    result = invoke(["train", *TINY, "--hybrid-layer-pattern", "M-"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert ("--hybrid-layer-pattern is an option of model 'hybrid' (plugtron-gpt "
            in result.output) and "add --model hybrid" in result.output


def test_an_option_of_a_disabled_extension_names_it():
    result = invoke(["train", *TINY, "-p", "no:tensorboard", "--tensorboard-dir", "tb"])
    assert result.exit_code == 2
    assert "--tensorboard-dir is an option of extension 'tensorboard'" in result.output
    assert "-p no:tensorboard" in result.output


def test_an_option_nobody_declares_is_still_unknown():
    result = invoke(["train", *TINY, "--no-such-thing", "1"])
    assert result.exit_code == 2 and "No such option" in result.output
    assert "is an option of" not in result.output


def test_a_list_setting_takes_several_values_after_one_flag():
    """Megatron's nargs for list settings: ``--flag A B`` reads as ``--flag A --flag B``; the
    values stop at the next flag (a negative number is a value)."""
    from plugtron.cli.options import expand_several_values

    assert expand_several_values(["--a", "x", "y", "--b", "1", "--a", "-1", "2", "--c=3"],
                                 {"--a"}) == ["--a", "x", "--a", "y", "--b", "1", "--a", "-1",
                                              "--a", "2", "--c=3"]
    assert expand_several_values(["--b", "1", "2"], {"--a"}) == ["--b", "1", "2"]


def test_a_list_setting_with_choices_checks_each_value():
    from dataclasses import dataclass

    from plugtron.core.config import TrainConfig, opt
    from plugtron.core.config_flags import apply_values
    from plugtron.core.errors import ConfigError

    @dataclass
    class Section:
        kinds: list[str] | str = opt("a", "--kinds", "Kinds.", choices=("a", "b"))

    config = TrainConfig()
    config.add_section("listed", Section)
    apply_values(config, {"kinds": ["a", "b"]}, "test")
    assert config.plugin_sections["listed"].kinds == ["a", "b"]
    with pytest.raises(ConfigError, match="--kinds 'c' is not one of a, b"):
        apply_values(config, {"kinds": ["a", "c"]}, "test")
