"""``--rerun-mode validate_results``: a step whose loss is NaN/Inf or a spike, or whose gradient
is NaN/Inf, runs once more on the same microbatches from the same RNG state before the optimizer
step. Faults are injected by extensions: once (transient: the run goes on with exactly a clean
run's losses) and always (reproducible: a NaN/Inf stops the run with an error and no optimizer
step; a spike is reported and training continues)."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.errors import ConfigError
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training import step_info
from plugtron.core.training.loop import setup, train
from plugtron.core.training.step_info import NonFiniteLossError
from plugtron.core.training.validate import validate
from plugtron.testing import train_run

from tests.utils import StepRecorder, tiny_config

ITERS = 5
AT = 3  # the iteration a fault hits


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class CorruptLoss:
    """Multiplies the per-token losses of rank 0 at iteration ``AT`` by ``factor`` (NaN: a
    non-finite loss; 1000: a spike): of the first microbatch only (once), or of every
    microbatch of the step and of its re-run (``always``)."""

    def __init__(self, factor: float, always: bool):
        self.factor, self.always, self.hits = factor, always, 0

    @hookimpl(wrapper=True)
    def forward_step(self, data_iterator, model):
        output, closure = yield
        if step_info.current.iteration != AT or _rank() != 0:
            return output, closure
        if self.hits and not self.always:
            return output, closure
        self.hits += 1
        return output, lambda out: closure(out * self.factor)


class CorruptGrad:
    """Makes one parameter's gradient NaN on rank 0 at iteration ``AT``, once or ``always``."""

    def __init__(self, always: bool):
        self.always, self.hits = always, 0

    def _hook(self, grad):
        if step_info.current.iteration == AT and _rank() == 0 and (self.always or not self.hits):
            self.hits += 1
            return grad * math.nan
        return grad

    @hookimpl
    def plugtron_model_built(self, config, model_chunks, parallel):
        next(iter(model_chunks[0].parameters())).register_hook(self._hook)


def _train(plugins=(), **flags):
    config = tiny_config(train_iters=ITERS, **flags)
    recorder = StepRecorder()
    run = setup(config, extra_plugins=[recorder, *plugins], world=single_process())
    train(run, MetricsLogger(config, rank=1))
    assert not step_info.current.defer_nonfinite  # only inside a validated step
    return recorder.records


def _losses(records):
    return [r["lm_loss"] for r in records]


@pytest.fixture(scope="module")
def clean():
    return _losses(_train())


VALIDATE = {"rerun_mode": "validate_results"}


@pytest.mark.parametrize("fault", [CorruptLoss(math.nan, always=False),
                                   CorruptGrad(always=False)], ids=["nan-loss", "nan-grad"])
def test_a_transient_fault_is_rerun_and_training_goes_on_as_if_clean(clean, fault):
    records = _train([fault], **VALIDATE)
    assert fault.hits == 1
    assert _losses(records) == clean  # bit for bit: the re-run's result is the clean step's
    reruns = [r for r in records if "rerun" in r]
    assert [(r["iteration"], r["rerun"]) for r in reruns] == [(AT, "transient")]
    assert not reruns[0]["skipped"]


@pytest.mark.parametrize("fault, reason", [(CorruptLoss(math.nan, always=True), "loss is nan"),
                                           (CorruptGrad(always=True), "a gradient is NaN")],
                         ids=["nan-loss", "nan-grad"])
def test_a_reproducible_fault_stops_with_an_error_and_no_step(fault, reason):
    recorder = StepRecorder()
    config = tiny_config(train_iters=ITERS, **VALIDATE)
    run = setup(config, extra_plugins=[recorder, fault], world=single_process())
    before = {n: p.detach().clone() for n, p in run.model_chunks[0].named_parameters()}
    with pytest.raises(NonFiniteLossError, match=f"{reason}.*reproducible, a problem of "
                                                 f"the data or the model"):
        train(run, MetricsLogger(config, rank=1))
    assert not step_info.current.defer_nonfinite
    assert fault.hits == 2 * 4  # every microbatch (global 8 / micro 2) of the step and re-run
    last = recorder.records[-1]
    assert (last["iteration"], last["rerun"], last["skipped"]) == (AT, "reproducible", True)
    assert reason in last["rerun_reason"]
    # ... and the optimizer did not step on it: the weights are those after iteration AT - 1
    assert len(recorder.records) == AT
    for name, param in run.model_chunks[0].named_parameters():
        assert torch.isfinite(param).all(), name
    assert any(not torch.equal(before[n], p) for n, p in run.model_chunks[0].named_parameters())


def test_a_nan_from_inside_the_model_is_rerun_not_raised_in_the_loss_function():
    class PoisonWeight:  # NaN weights from iteration AT on: the loss function sees the NaN
        @hookimpl(wrapper=True)
        def forward_step(self, data_iterator, model):
            if step_info.current.iteration == AT:
                with torch.no_grad():
                    next(iter(model.parameters())).fill_(math.nan)
            return (yield)

    with pytest.raises(NonFiniteLossError, match="reproducible"):
        _train([PoisonWeight()], **VALIDATE)


def test_spikes_once_and_always(clean):
    flags = {**VALIDATE, "check_for_spiky_loss": True}
    once = _train([CorruptLoss(1000.0, always=False)], **flags)
    assert _losses(once) == clean
    assert [(r["iteration"], r["rerun"]) for r in once if "rerun" in r] == [(AT, "transient")]
    assert "is over 10 x" in once[AT - 1]["rerun_reason"]
    always = _train([CorruptLoss(1000.0, always=True)], **flags)  # not fatal, as in Megatron
    assert [(r["iteration"], r["rerun"]) for r in always if "rerun" in r] == [(AT, "reproducible")]
    assert len(always) == ITERS and always[AT - 1]["lm_loss"] > 10 * max(clean)
    # without the spike check, a spike is not validated
    assert not any("rerun" in r for r in _train([CorruptLoss(1000.0, False)], **VALIDATE))


def test_disabled_mode_is_the_default_and_report_stats_is_refused():
    assert tiny_config().training.rerun_mode == "disabled"
    with pytest.raises(ConfigError, match="report_stats .* is not implemented"):
        validate(tiny_config(rerun_mode="report_stats"), 1)


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2, timeout=300)


@pytest.mark.parametrize("layout", [{"dp": 2}, {"pp": 2}], ids=["dp2", "pp2"])
def test_two_ranks_agree_on_a_fault_of_one(pool, layout):
    flags = {"train_iters": ITERS, **layout, **VALIDATE}
    clean2 = train_run({"train_iters": ITERS, **layout}, pool=pool)
    result = train_run(flags, pool=pool, plugins=[CorruptGrad(always=False)])
    assert result.series("lm_loss") == clean2.series("lm_loss")
    assert [(r["iteration"], r["rerun"]) for r in result.records if "rerun" in r] == [
        (AT, "transient")]


def test_console_and_metrics_file_say_what_the_rerun_found(tmp_path, capsys):
    config = tiny_config(log_interval=1, metrics_file=str(tmp_path / "m.jsonl"), **VALIDATE)
    logger = MetricsLogger(config, rank=0)
    logger.train_step({"iteration": AT, "lm_loss": 2.0, "grad_norm": 1.0, "lr": 1e-3,
                       "tokens_per_sec": 10.0, "step_time_s": 0.5, "rerun": "transient",
                       "rerun_reason": "loss is nan"})
    logger.close()
    out = capsys.readouterr().out
    assert (f"rerun at iteration {AT}: loss is nan; the step was re-run on the same data: "
            f"transient: not repeated on the same data, a hardware fault") in out
    assert "rerun" not in out.splitlines()[0]  # not taken for a loss
    assert '"rerun": "transient"' in (tmp_path / "m.jsonl").read_text()


def test_cli_exit_codes(tmp_path):
    args = ["train", "--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters",
            "3", "--no-progress", "--eval-interval", "0", "--log-interval", "1"]
    refused = CliRunner().invoke(cli, [*args, "--rerun-mode", "report_stats"])
    assert refused.exit_code == 2 and "report_stats" in refused.output
    # lr 1e30: the weights blow up after the first step; NaN reproducible at iteration 2
    metrics = tmp_path / "m.jsonl"
    done = CliRunner().invoke(cli, [*args, "--lr", "1e30", "--min-lr", "0", "--rerun-mode",
                                    "validate_results", "--metrics-file", str(metrics)])
    assert done.exit_code == 2, done.output
    assert "rerun at iteration 2: loss is nan" in done.output
    assert "reproducible, a problem of the data or the model" in done.output
    assert '"rerun": "reproducible"' in metrics.read_text().splitlines()[-1]
