"""Helpers for the data-parallel tests: uneven loss masks and short training runs that return
losses and parameters (picklable, so pool workers can send them back)."""

from __future__ import annotations

import torch
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.training import step_info
from plugtron.core.training.loop import setup, train
from plugtron.core.training.optimizer import named_params

from tests.utils import StepRecorder, tiny_config

#: The matrix's base settings: several buckets (bucket size far below the model size).
DP_BASE = {"train_iters": 10, "global_batch_size": 8, "micro_batch_size": 2,
           "ddp_bucket_size": 3000}


#: The data-parallel settings every dp size is checked under.
VARIANTS = {
    "plain": {},
    "overlap": {"overlap_grad_reduce": True},
    "distributed": {"use_distributed_optimizer": True},
    "distributed+overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                            "overlap_param_gather": True},
}


class _MaskedDataset:
    """Wraps a dataset: sample ``i`` keeps only its first ``1 + 5i mod seq`` loss tokens, and
    every seventh sample none, so ranks and microbatches hold very different token counts."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        sample = dict(self.dataset[index])
        seq = sample["loss_mask"].numel()
        keep = 0 if index % 7 == 3 else 1 + (5 * index) % seq
        sample["loss_mask"] = (torch.arange(seq) < keep).float()
        return sample


class UnevenLossMask:
    """Extension plugin: wraps whatever the dataset provider returns."""

    @hookimpl(wrapper=True)
    def dataset_provider(self):
        datasets = yield
        return tuple(None if d is None else _MaskedDataset(d) for d in datasets)


class InjectNonFinite:
    """Makes the gradient of the model's last parameter inf at ``iteration`` (on data-parallel
    rank ``dp_rank`` and context-parallel rank ``cp_rank`` only, when given): a forced fp16
    overflow."""

    def __init__(self, iteration: int, dp_rank: int | None = None, cp_rank: int | None = None):
        self.iteration = iteration
        self.dp_rank, self.cp_rank = dp_rank, cp_rank

    def attach(self, run) -> None:
        if self.dp_rank is not None and run.parallel.dp_rank != self.dp_rank:
            return
        if self.cp_rank is not None and run.parallel.cp_rank != self.cp_rank:
            return
        param = named_params(run.model_chunks)[-1][1]
        param.register_hook(lambda g: g * float("inf")
                            if step_info.current.iteration == self.iteration else g)


def params_of(run) -> dict[str, torch.Tensor]:
    for chunk in run.model_chunks:
        chunk.finish_param_sync()
    return {name: p.detach().float().clone() for name, p in named_params(run.model_chunks)}


def main_params(run) -> dict[str, torch.Tensor]:
    """The fp32 values the optimizer steps: its main params under bf16/fp16, else the params."""
    state = run.optimizer.sharded_state_dict()
    return {name: state[name].get("main_param", p.detach()).float().clone()
            for name, p in named_params(run.model_chunks)}


def bf16_ulps(a: dict, b: dict) -> int:
    """Largest distance between a and b in bf16 steps (0: equal in bf16, 1: neighbours)."""
    assert sorted(a) == sorted(b)

    def ordinal(t: torch.Tensor) -> torch.Tensor:  # bf16 bit patterns in the order of values
        bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return max(int((ordinal(a[k]) - ordinal(b[k])).abs().max()) for k in a)


def train_run(overrides: dict, world=None, masked: bool = True, before_train=None,
              stop_after: int | None = None):
    """Train ``tiny_config(DP_BASE | overrides)``, stopping after ``stop_after`` iterations
    when given (the data and lr schedule still those of the full run); returns
    (records, params, run)."""
    config = tiny_config(**{**DP_BASE, **overrides})
    recorder = StepRecorder()
    plugins = [recorder] + ([UnevenLossMask()] if masked else [])
    run = setup(config, extra_plugins=plugins, world=world)
    if stop_after is not None:
        config.training.train_iters = stop_after
    if before_train is not None:
        before_train(run)
    train(run, MetricsLogger(config, rank=1))
    return recorder.records, params_of(run), run


def losses(records) -> list[float]:
    return [r["lm_loss"] for r in records]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def max_param_diff(a: dict, b: dict) -> float:
    """Largest elementwise |a - b| over all parameters (names must match)."""
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def state_after(overrides: dict, iterations: int, world=None):
    """Train the first ``iterations`` steps of a run; returns (optimizer sharded state, params,
    records)."""
    records, params, run = train_run(overrides, world, stop_after=iterations)
    return run.optimizer.sharded_state_dict(), params, records


def resume_run(overrides: dict, state: dict, params: dict, done: int, world=None):
    """Load ``params`` and optimizer ``state`` saved after ``done`` steps and train the rest of
    the run; returns (records of the new steps, params, the optimizer's main params)."""
    config = tiny_config(**{**DP_BASE, **overrides})
    recorder = StepRecorder()
    run = setup(config, extra_plugins=[recorder, UnevenLossMask()], world=world)
    with torch.no_grad():
        for name, param in named_params(run.model_chunks):
            param.copy_(params[name])
    run.optimizer.load_sharded_state_dict(state)
    run.state.iteration = done
    run.state.consumed_samples = done * config.training.global_batch_size
    train(run, MetricsLogger(config, rank=1))
    return recorder.records, params_of(run), main_params(run)


def one_thread():
    """Generator for an autouse module fixture: torch on one thread in the test process. With
    the cores oversubscribed (parallel test runs), two intra-op threads make these small runs
    30-70x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- pool workers


def pool_train(rank, world_size, overrides, stop_after=None, inject=None):
    """In every rank of a pool: one run on the pool's world; a summary the test can compare."""
    before = InjectNonFinite(*inject).attach if inject else None
    records, params, run = train_run(overrides, before_train=before, stop_after=stop_after)
    capacity = sum(b.shard_size for chunk in run.model_chunks for buffer in chunk.grad_buffers
                   for b in buffer.buckets)
    return {"losses": losses(records), "params": params,
            "skipped": [r["skipped"] for r in records],
            "loss_scale": [r.get("loss_scale") for r in records],
            "grad_norm": [r["grad_norm"] for r in records],
            "state_bytes": run.optimizer.state_bytes(), "shard_capacity": capacity}


def pool_state_after(rank, world_size, overrides, iterations):
    return state_after(overrides, iterations)[:2]


def pool_resume(rank, world_size, overrides, state, params, done):
    records, final, _ = resume_run(overrides, state, params, done)
    return losses(records), final
