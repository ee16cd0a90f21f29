"""A checkpoint written before the core was regrouped (and before GPT's fields left the core's
model section) resumes bitwise: same losses and grad norms as the run that wrote it, had it not
stopped. The checkpoint (tests/core/checkpoint/data/written_before_the_house/) and the uninterrupted
run's figures were made by that older plugtron with the flags in expected.json: a GPT with rope,
SwiGLU, grouped queries, no linear biases, RMSNorm and two experts per layer."""

from __future__ import annotations

import json
import pathlib
import shutil

from click.testing import CliRunner
from plugtron.cli.main import cli

DATA = pathlib.Path(__file__).parent / "data" / "written_before_the_house"


def _argv(flags: dict) -> list[str]:
    out = []
    for name, value in flags.items():
        out += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return out


def test_an_old_checkpoint_resumes_bitwise(tmp_path):
    expected = json.loads((DATA / "expected.json").read_text())
    checkpoint = tmp_path / "ck"
    shutil.copytree(DATA, checkpoint, ignore=shutil.ignore_patterns("expected.json"))
    metrics = tmp_path / "metrics.jsonl"
    result = CliRunner().invoke(cli, ["train", *_argv(expected["flags"]),
                                      "--train-iters", str(expected["train_iters"]),
                                      "--load", str(checkpoint), "--metrics-file", str(metrics)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    resumed = {str(r["iteration"]): {"lm_loss": r["lm_loss"], "grad_norm": r["grad_norm"]}
               for r in records if "iteration" in r and not r.get("summary")}
    assert resumed == expected["uninterrupted"]


def test_the_kit_reads_a_checkpoint_whole(tmp_path):
    from plugtron.testing import read_checkpoint

    shutil.copytree(DATA, tmp_path / "ck", ignore=shutil.ignore_patterns("expected.json"))
    contents = read_checkpoint(str(tmp_path / "ck"))
    assert contents["iteration"] == 3 and contents["config"]["model"]["swiglu"] is True
    embedding = contents["tensors"]["model/embedding.word_embeddings.weight"]
    assert tuple(embedding.shape) == (104, 16)  # vocab 100 padded to a multiple of 8
