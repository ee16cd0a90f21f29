"""``plugtron evaluate`` with several document sets: one line (and JSON record) each with its
loss and perplexity, each equal to evaluating that set alone."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core import checkpoint
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training import loop as training

from tests.utils import tiny_config


def test_one_line_per_document_set(tmp_path):
    texts = {"a.txt": "def f(x):\n    return x + 1\n" * 12, "b.txt": "Lorem ipsum dolor. " * 20}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    a, b, ck = str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), str(tmp_path / "ck")
    config = tiny_config(data="text", vocab_size=None, data_path=[a], split="1,0,0",
                         train_iters=1, global_batch_size=2, save=ck)
    run = training.setup(config, world=single_process())
    checkpoint.load_if_requested(run)
    training.train(run, MetricsLogger(config, rank=1))

    def evaluate(*paths, json_out=True):
        args = ["evaluate", "--load", ck, "--split", "0,1,0", "--eval-iters", "2",
                "--no-progress", *(["--json"] if json_out else [])]
        for path in paths:
            args += ["--data-path", path]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        return result.output

    lines = [json.loads(line) for line in evaluate(a, b).splitlines() if line.startswith("{")]
    assert [line["data_path"] for line in lines] == [a, b]
    alone = [json.loads(line) for line in evaluate(b).splitlines() if line.startswith("{")]
    assert len(alone) == 1 and abs(alone[0]["valid_lm_loss"] - lines[1]["valid_lm_loss"]) < 1e-6
    for line in lines:
        assert abs(line["valid_perplexity"] - math.exp(line["valid_lm_loss"])) < 1e-6
    assert lines[0]["valid_lm_loss"] != lines[1]["valid_lm_loss"]
    text = evaluate(a, b, json_out=False)
    assert f"{a}: lm loss {lines[0]['valid_lm_loss']:.4f} | perplexity" in text
