"""Contract v2: plugins own their options (typed sections), their checks, their main loss key and
presets; one broken plugin does not take the others' options away."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_dict, config_from_flags

from tests.fake_plugins import install_fake_distribution, remove_path
from tests.utils import TINY

CSV_LOGGER = """
import dataclasses
from plugtron.api import ConfigError, ConfigSection, hookimpl, opt

@dataclasses.dataclass
class CsvOptions:
    csv_log: str = opt("", "--csv-log", "Write one CSV row per step here.")
    csv_every: int = opt(1, "--csv-every", "Every N steps.")

class CsvLogger:
    def __init__(self):
        self.path = None

    @hookimpl
    def plugtron_config_sections(self):
        return [ConfigSection("csv", CsvOptions, title="CSV logger")]

    @hookimpl
    def plugtron_validate(self, config, world_size):
        if config.csv.csv_every < 1:
            raise ConfigError(f"--csv-every must be at least 1, got {config.csv.csv_every}")

    @hookimpl
    def plugtron_configure(self, config):
        self.path = config.csv.csv_log
        self.every = config.csv.csv_every

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        if self.path and iteration % self.every == 0:
            with open(self.path, "a") as f:
                f.write(f"{iteration},{metrics['lm_loss']}\\n")
"""

BROKEN = "raise ImportError('this extension is broken')\n"

CLASHING = """
import dataclasses
from plugtron.api import ConfigSection, hookimpl, opt

@dataclasses.dataclass
class Steal:
    lr: float = opt(1.0, "--lr", "clashes with the core's --lr")

class Clash:
    @hookimpl
    def plugtron_config_sections(self):
        return [ConfigSection("clash", Steal)]
"""

ARGS = ["--data", "mock", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
        "--vocab-size", "64", "--no-progress", "--eval-interval", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0"]


@pytest.fixture()
def extensions(tmp_path):
    install_fake_distribution(tmp_path, "plugtron-csvlog", "1.2",
                              {"plugtron": {"csvlog": "fake_csvlog:CsvLogger",
                                            "broken": "fake_broken:Broken",
                                            "clash": "fake_clash:Clash"}},
                              {"fake_csvlog": CSV_LOGGER, "fake_broken": BROKEN,
                               "fake_clash": CLASHING})
    yield tmp_path
    remove_path(tmp_path)


def invoke(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_hook_plugtron_config_sections(extensions, tmp_path):
    """Options appear under their distribution's heading, reach the plugin typed, come from
    config files and land in the checkpoint's config; the broken and the clashing extension
    are skipped with a warning and take nothing away."""
    result = invoke(["train", "-p", "no:broken", "--help"])
    assert "CSV logger (plugtron-csvlog 1.2):" in result.output
    assert "--csv-log" in result.output and "--csv-every" in result.output

    result = invoke(["train", "--help"])  # the broken one is not disabled here
    assert "--csv-log" in result.output
    assert "skipping extension 'broken'" in result.output or result.exit_code == 0

    csv = tmp_path / "steps.csv"
    config_file = tmp_path / "run.yaml"
    config_file.write_text("csv-every: 2\n")
    save = tmp_path / "ck"
    result = invoke(["train", *ARGS, "-p", "no:broken", "--config", str(config_file),
                     "--csv-log", str(csv), "--save", str(save)])
    assert result.exit_code == 0, result.output
    assert [line.split(",")[0] for line in csv.read_text().splitlines()] == ["2"]
    from plugtron.core.checkpoint import CheckpointReader

    saved = CheckpointReader(str(save)).config
    assert saved["csv"] == {"csv_log": str(csv), "csv_every": 2}
    assert "clash" not in saved
    restored = config_from_dict(saved)
    assert restored.csv.csv_every == 2


def test_hook_plugtron_validate(extensions):
    """A plugin's ConfigError stops the run before launch: exit 2, printed once."""
    result = invoke(["train", *ARGS, "-p", "no:broken", "--csv-every", "0",
                     "--nproc-per-node", "2"])
    assert result.exit_code == 2
    assert result.output.count("--csv-every must be at least 1, got 0") == 1
    assert "Traceback" not in result.output


def test_a_broken_extension_fails_the_run_by_name_but_not_the_help(extensions):
    result = invoke(["train", *ARGS])
    assert result.exit_code == 2
    assert "broken" in result.output and "-p no:broken" in result.output
    assert "Traceback" not in result.output


def test_hook_model_info():
    """The GPT plugin names its main loss and the settings a resume must match."""
    from plugtron.core.contracts.model_info import ModelInfo
    from plugtron.core.plugins import registry

    gpt = registry.instantiate(registry.load("model", "gpt"))
    info = gpt.model_info(config_from_flags(TINY))
    assert isinstance(info, ModelInfo) and info.main_loss == "lm loss"
    assert info.architecture["--num-attention-heads"] == 4
    assert info.architecture["--ffn-hidden-size"] == 4 * 32


def test_hook_model_presets():
    result = invoke(["train", "--preset", "tiny", "--data", "mock", "--vocab-size", "64",
                     "--train-iters", "1", "--no-progress", "--eval-interval", "0"])
    assert result.exit_code == 0, result.output
    result = invoke(["train", "--preset", "huge"])
    assert result.exit_code == 2
    assert "--preset 'huge' is not a preset of model 'gpt'; its presets: gpt2-124m" in \
        result.output


def test_gpt_size_rules_live_in_the_gpt_plugin():
    from plugtron.core.errors import ConfigError
    from plugtron.core.training.validate import validate

    with pytest.raises(ConfigError, match="not divisible by --num-attention-heads 4"):
        validate(config_from_flags({**TINY, "hidden_size": 30}), 1)
    # The core alone has no opinion about heads: a config for another model passes.
    from plugtron.core.training.validate import validate_tensor_parallel

    validate_tensor_parallel(config_from_flags({**TINY, "hidden_size": 30}), 1)


@pytest.mark.parametrize("flag,value,message", [
    # --ep and --etp are built (plugtron-moe), but split nothing without experts.
    ("--etp", "2", "needs --num-experts"),
    ("--ep", "2", "needs --num-experts")])
def test_parallel_sizes_not_built_yet_are_refused(flag, value, message):
    result = invoke(["train", *ARGS, "--nproc-per-node", "2", flag, value])
    assert result.exit_code == 2
    assert message in result.output


def test_a_report_without_lm_loss_trains(capsys):
    """Reports with other keys ({"loss": ...}, a plain number) are logged, not a TypeError,
    also when the model's main key is missing from them."""
    import torch
    from plugtron.api import hookimpl
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.training.loop import reduce_reports, setup, train

    from tests.utils import tiny_config

    def renamed(closure):
        def run(output):
            loss, count, report = closure(output)
            return loss, count, {"loss": report["lm loss"], "accuracy": torch.tensor(0.5)}
        return run

    class OtherKeys:
        @hookimpl(wrapper=True)
        def forward_step(self, data_iterator, model):
            output, closure = yield
            return output, renamed(closure)

    run = setup(tiny_config(train_iters=2, log_interval=1), extra_plugins=[OtherKeys()],
                world=single_process())
    summary = train(run, MetricsLogger(run.config, rank=0, main_loss="lm_loss"))
    out = capsys.readouterr().out
    assert "| loss " in out and "accuracy 0.5000" in out
    assert summary["final_loss"] is None  # the GPT plugin names "lm loss" its main key
    assert reduce_reports([{"loss": torch.tensor([6.0, 3.0]), "num_tokens": torch.tensor(3.0)}],
                          run.parallel) == {"loss": 2.0}


CONFIGURE_FAILS = """
from plugtron.api import ConfigError, hookimpl

class Picky:
    @hookimpl
    def plugtron_configure(self, config):
        raise ConfigError("picky refuses this run: --seed must be 7")
"""


def test_a_configure_error_in_ranks_is_printed_once(tmp_path, monkeypatch):
    """plugtron_configure runs inside the ranks: its ConfigError still exits 2, once."""
    install_fake_distribution(tmp_path, "plugtron-picky", "0.1",
                              {"plugtron": {"picky": "fake_picky:Picky"}},
                              {"fake_picky": CONFIGURE_FAILS})
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    try:
        import subprocess
        import sys

        result = subprocess.run([sys.executable, "-m", "plugtron.cli.main", "train", *ARGS,
                                 "--nproc-per-node", "2"], capture_output=True, text=True,
                                timeout=240)
    finally:
        remove_path(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.count("picky refuses this run: --seed must be 7") == 1, output
    assert "Traceback" not in output


def test_driver_loading_stays_lazy_and_uninstalled_options_go(tmp_path):
    """A broken model plugin that the run does not select costs nothing, and a plugin's options
    disappear with its package."""
    install_fake_distribution(tmp_path, "plugtron-badmodel", "0.1",
                              {"plugtron.models": {"badmodel": "fake_badmodel:Bad"},
                               "plugtron": {"csvlog": "fake_csvlog:CsvLogger"}},
                              {"fake_badmodel": BROKEN, "fake_csvlog": CSV_LOGGER})
    try:
        result = invoke(["train", "--help"])
        assert result.exit_code == 0 and "fake_badmodel" not in result.output
        assert "--csv-log" in result.output
        result = invoke(["train", "--model", "badmodel"])
        assert result.exit_code == 2
        assert "model 'badmodel' from plugtron-badmodel 0.1 failed to import" in result.output
    finally:
        remove_path(tmp_path)
    assert "--csv-log" not in invoke(["train", "--help"]).output


def test_a_plugin_field_named_like_a_core_field_does_not_capture_bare_keys(tmp_path):
    import dataclasses

    from plugtron.api import opt
    from plugtron.core.config import TrainConfig
    from plugtron.core.config_flags import apply_values, load_config_file
    from plugtron.core.errors import ConfigError

    @dataclasses.dataclass
    class Shadow:
        seed: int = opt(0, "--shadow-seed", "a plugin field named like the core's --seed")

    config = TrainConfig()
    config.add_section("shadow", Shadow)
    apply_values(config, {"seed": 5}, "test")
    assert config.training.seed == 5 and config.shadow.seed == 0
    apply_values(config, {"shadow.seed": 7, "shadow_seed": 8}, "test")
    assert config.shadow.seed == 8 and config.training.seed == 5
    apply_values(config, {"shadow.seed": 7}, "test")
    assert config.shadow.seed == 7
    file = tmp_path / "c.yaml"
    file.write_text("training:\n  seed: 3\nshadow:\n  seed: 4\n")
    apply_values(config, load_config_file(str(file)), "file")
    assert (config.training.seed, config.shadow.seed) == (3, 4)
    bare_plugin = TrainConfig()
    bare_plugin.add_section("shadow", Shadow)
    with pytest.raises(ConfigError, match="unknown setting"):
        apply_values(bare_plugin, {"shadow.nope": 1}, "test")
