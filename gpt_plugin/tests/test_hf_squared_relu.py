"""A GPT model trained with --squared-relu has no Llama/GPT-2 equivalent: export-hf refuses it
with exit 2 naming the option and the transformers family that has it (NemotronH), instead of
writing a GeLU/SiLU config over relu^2 weights."""

from __future__ import annotations

import os

from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import checkpointer
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup

from tests.core.checkpoint.helpers import ckpt_config


def test_export_hf_refuses_squared_relu(tmp_path):
    run = setup(ckpt_config(save=str(tmp_path / "save"), squared_relu=True),
                world=single_process())
    checkpointer(run).save(0)
    out = tmp_path / "hf"
    result = CliRunner().invoke(cli, ["convert", "export-hf", str(tmp_path / "save"), str(out)])
    assert result.exit_code == 2, result.output
    assert "--squared-relu" in result.output and "NemotronH" in result.output
    assert "Traceback" not in result.output
    assert not os.path.exists(out) or not os.listdir(out)
