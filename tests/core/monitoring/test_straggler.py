"""``--log-straggler``: every --log-interval iterations each rank's forward-backward time is
gathered and the fastest and slowest ranks are named, in the metrics records and on the
console; a rank slowed by an extension (a sleep in its forward step) is named the slowest."""

from __future__ import annotations

import json
import time

import pytest
import torch
from plugtron.core.config import TrainConfig
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.errors import ConfigError
from plugtron.core.monitoring import straggler
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.training.validate import validate
from plugtron.testing import train_run

from tests.utils import tiny_config

#: per microbatch: 0.5 s a step (2 microbatches a rank), far above a tiny step even when the
#: machine is loaded (CI runs two test workers and their ranks on two cores)
SLEEP_S = 0.25


class SlowRank:
    """Extension plugin: rank ``rank`` sleeps in every forward step (a slow GPU)."""

    def __init__(self, rank: int):
        self.rank = rank

    @hookimpl(wrapper=True)
    def forward_step(self, data_iterator, model):
        if torch.distributed.get_rank() == self.rank:
            time.sleep(SLEEP_S)
        return (yield)


def test_the_slowed_rank_is_named_the_slowest():
    result = train_run({"train_iters": 4, "log_interval": 2, "log_straggler": True, "dp": 2},
                       plugins=[SlowRank(1)])
    reports = [r for r in result.records if "straggler_max_rank" in r]
    assert [r["iteration"] for r in reports] == [2, 4]  # at the log interval only
    for record in reports:
        assert record["straggler_max_rank"] == 1 and record["straggler_min_rank"] == 0
        # two microbatches per rank (global batch 8, micro batch 2, dp 2)
        assert record["straggler_max_s"] >= 2 * SLEEP_S
        assert record["straggler_min_s"] < record["straggler_max_s"]


def test_without_the_flag_nothing_is_gathered():
    result = train_run({"train_iters": 2, "log_interval": 1, "dp": 2})
    assert not any(key in r for r in result.records for key in straggler.KEYS)


def test_console_line_and_metrics_file(tmp_path, capsys):
    config: TrainConfig = tiny_config(log_straggler=True, log_interval=2,
                                      metrics_file=str(tmp_path / "m.jsonl"))
    logger = MetricsLogger(config, rank=0)
    base = {"lm_loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 10.0,
            "step_time_s": 0.5}
    logger.train_step({"iteration": 2, **base, "straggler_min_s": 0.012,
                       "straggler_min_rank": 3, "straggler_max_s": 0.25,
                       "straggler_max_rank": 1})
    logger.close()
    out = capsys.readouterr().out
    assert ("straggler at iteration 2 | forward-backward time min 12.0 ms (rank 3) | "
            "max 250.0 ms (rank 1)") in out
    assert "straggler" not in out.splitlines()[0]  # not taken for a loss on the main line
    record = json.loads((tmp_path / "m.jsonl").read_text())
    assert record["straggler_max_rank"] == 1 and record["straggler_max_s"] == 0.25


def test_needs_a_log_interval():
    with pytest.raises(ConfigError, match="--log-straggler reports every --log-interval"):
        validate(tiny_config(log_straggler=True, log_interval=0), 1)
