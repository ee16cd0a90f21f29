"""One training run: pretrain -> train -> train_step (DESIGN section 4)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import checkpoint, comm, data, grads, registry, step_info
from .config import TrainConfig, num_microbatches, padded_vocab_size
from .ddp import DistributedDataParallel
from .distributed import WorldInfo, init_distributed
from .errors import ConfigError
from .lr_schedule import LRScheduler
from .metrics import MetricsLogger, Throughput
from .optimizer import checked_optimizer
from .p2p import P2PCommunicator
from .parallel_context import ParallelContext
from .plugin_manager import build_plugin_manager, wants_sharded_gradients
from .random import seed_everything
from .schedule_plan import check_schedule


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


@dataclass
class Run:
    """Everything one rank built for a run."""

    config: TrainConfig
    world: WorldInfo
    parallel: ParallelContext
    pm: object
    backend: object
    model_chunks: list
    optimizer: object
    scheduler: LRScheduler
    datasets: tuple
    p2p: object = None
    checkpointer: object = None  # core.checkpoint.Checkpointer, made on first use
    state: TrainState = field(default_factory=TrainState)

    @property
    def num_microbatches(self) -> int:
        return num_microbatches(self.config, self.parallel.dp_size)

    def forward_step_func(self, data_iterator, model):
        return self.pm.hook.forward_step(data_iterator=data_iterator, model=model)


def build_parallel(config: TrainConfig, world: WorldInfo) -> ParallelContext:
    p = config.parallel
    return ParallelContext.build(
        world.world_size, world.rank, tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size, vp=p.virtual_pipeline_model_parallel_size,
        cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size, device=world.device)


def split_sizes(config: TrainConfig) -> tuple[int, int, int]:
    t = config.training
    return (t.train_iters * t.global_batch_size, t.eval_iters * t.global_batch_size,
            t.eval_iters * t.global_batch_size)


def finalize_model_config(config: TrainConfig, parallel: ParallelContext) -> None:
    m = config.model
    if m.vocab_size is None:
        raise ConfigError(f"data {config.plugins.data!r} does not fix the vocabulary: give "
                          f"--vocab-size")
    m.padded_vocab_size = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by,
                                            parallel.tp_size)


def model_dtype(config: TrainConfig) -> torch.dtype:
    if config.training.bf16:
        return torch.bfloat16
    if config.training.fp16:
        return torch.float16
    return torch.float32


def build_model_chunks(config, pm, backend, parallel, device) -> list:
    vp = config.parallel.virtual_pipeline_model_parallel_size
    sharded = wants_sharded_gradients(config, pm)
    chunks = []
    for stage in range(vp or 1):
        pre = parallel.is_pipeline_first_stage() and stage == 0
        post = parallel.is_pipeline_last_stage() and stage == (vp or 1) - 1
        module = pm.hook.model_provider(config=config, pre_process=pre, post_process=post,
                                        vp_stage=stage if vp else None, layer_backend=backend,
                                        parallel=parallel)
        module.to(device=device, dtype=model_dtype(config))
        chunks.append(DistributedDataParallel(module, config, parallel, sharded=sharded))
    return chunks


def setup(config: TrainConfig, extra_plugins=(), world: WorldInfo | None = None) -> Run:
    """Build everything one rank needs. ``world`` defaults to the torchrun/initialised world."""
    world = world or init_distributed()
    parallel = build_parallel(config, world)
    step_info.current.rank = world.rank
    pm = build_plugin_manager(config, extra_plugins)
    pm.hook.plugtron_configure.call_historic(kwargs={"config": config})
    pm.hook.plugtron_process_groups_ready.call_historic(kwargs={"parallel": parallel})
    # A schedule that cannot run this layout fails now, not at the first step.
    check_schedule(pm.hook.schedule_actions, parallel.pp_size, parallel.vp_size or 1,
                   num_microbatches(config, parallel.dp_size), config)
    seed_everything(config.training.seed, parallel)

    datasets = pm.hook.dataset_provider(config=config, split_sizes=split_sizes(config),
                                        parallel=parallel)
    finalize_model_config(config, parallel)
    backend_cls = registry.load("layer_backend", config.plugins.layer_backend)
    backend = backend_cls(config, parallel)

    model_chunks = build_model_chunks(config, pm, backend, parallel, world.device)
    pm.hook.plugtron_model_built(config=config, model_chunks=model_chunks, parallel=parallel)
    optimizer = checked_optimizer(pm.hook.build_optimizer(
        config=config, model_chunks=model_chunks, parallel=parallel), config)
    scheduler = LRScheduler.from_config(optimizer, config)
    p2p = None
    if parallel.pp_size > 1:
        p2p = P2PCommunicator.from_config(config, parallel, model_dtype(config), world.device)
    return Run(config, world, parallel, pm, backend, model_chunks, optimizer, scheduler,
               tuple(datasets), p2p)


# --------------------------------------------------------------------------- the step


def data_iterators(run: Run, dataset, consumed_samples: int) -> list:
    """One iterator per model chunk, all at the same position (interleaving draws each chunk's
    microbatches in its own order)."""
    mbs = run.config.training.micro_batch_size
    return [data.microbatch_iterator(dataset, mbs, run.parallel.dp_rank, run.parallel.dp_size,
                                     consumed_samples)
            for _ in run.model_chunks]


def reduce_reports(reports: list[dict], parallel: ParallelContext) -> dict[str, float]:
    """Token-weighted means of every ``[sum, count]`` report key over microbatches, data-parallel
    ranks and (from the last stage) the whole pipeline."""
    keys = sorted({k for r in reports for k in r if k != "num_tokens"})
    keys = keys or ["lm loss"]
    totals = torch.zeros(len(keys), 2, dtype=torch.float64)
    for report in reports:
        for i, key in enumerate(keys):
            if key in report:
                totals[i] += report[key].detach().to("cpu", torch.float64).reshape(2)
    # Every rank takes part: the keys of the last stage are the model's and the same on all.
    comm.all_reduce(totals, parallel.dp_cp_group)
    comm.all_reduce(totals, parallel.pp_group)
    return {k: (totals[i, 0] / totals[i, 1].clamp(min=1)).item() for i, k in enumerate(keys)}


def run_schedule(run: Run, iterators, forward_only: bool) -> list[dict]:
    chunks_iter = iterators if len(iterators) > 1 else iterators[0]
    return run.pm.hook.forward_backward(
        forward_step_func=run.forward_step_func, data_iterator=chunks_iter,
        model=run.model_chunks, num_microbatches=run.num_microbatches,
        seq_length=run.config.model.seq_length,
        micro_batch_size=run.config.training.micro_batch_size, forward_only=forward_only,
        parallel=run.parallel, config=run.config, p2p=run.p2p,
        loss_scale=run.optimizer.loss_scale())


def train_step(run: Run, iterators) -> tuple[dict, object]:
    run.optimizer.zero_grad()
    for chunk in run.model_chunks:  # after the optimizer: it may point .grad into the buffers
        chunk.zero_grad_buffer()
    reports = run_schedule(run, iterators, forward_only=False)
    num_tokens = torch.zeros((), dtype=torch.float32)
    for report in reports:
        num_tokens += report["num_tokens"].float().cpu()
    grads.finalize_model_grads(run.model_chunks, run.parallel, num_tokens)
    result = run.optimizer.step()
    return reduce_reports(reports, run.parallel), result


def evaluate(run: Run) -> float | None:
    valid = run.datasets[1] if len(run.datasets) > 1 else None
    if valid is None or run.config.training.eval_iters == 0:
        return None
    for chunk in run.model_chunks:
        chunk.eval()
    reports = []
    iterators = data_iterators(run, valid, 0)
    try:
        for _ in range(run.config.training.eval_iters):
            reports += run_schedule(run, iterators, forward_only=True)
    except StopIteration:
        pass  # a validation split smaller than eval_iters batches: use what there is
    finally:
        for chunk in run.model_chunks:
            chunk.train()
    return reduce_reports(reports, run.parallel).get("lm loss")


def train(run: Run, metrics: MetricsLogger) -> dict:
    config, state = run.config, run.state
    t = config.training
    tokens_per_iter = t.global_batch_size * config.model.seq_length
    iterators = data_iterators(run, run.datasets[0], state.consumed_samples)
    run.pm.hook.plugtron_train_start(config=config, state=state)
    throughput = Throughput()
    losses = {}
    start = time.perf_counter()
    while state.iteration < t.train_iters:
        iteration = state.iteration + 1
        step_info.current.iteration = iteration
        lr = run.scheduler.prepare(iteration)
        step_start = time.perf_counter()
        try:
            losses, result = train_step(run, iterators)
        except StopIteration:
            raise ConfigError(f"the training data ran out at iteration {iteration}; the dataset "
                              f"is smaller than --train-iters x --global-batch-size") from None
        step_time = time.perf_counter() - step_start
        state.iteration = iteration
        state.consumed_samples += t.global_batch_size
        record = {"iteration": iteration, "lm_loss": losses.get("lm loss"),
                  "grad_norm": result.grad_norm, "lr": lr,
                  "tokens_per_sec": throughput.add(tokens_per_iter), "step_time_s": step_time,
                  "consumed_samples": state.consumed_samples, "skipped": not result.stepped}
        if result.num_zeros is not None:
            record["num_zeros"] = result.num_zeros
        if hasattr(run.optimizer, "current_loss_scale"):
            record["loss_scale"] = run.optimizer.current_loss_scale()
        metrics.train_step(record)
        run.pm.hook.plugtron_step_end(iteration=iteration, metrics=record)
        if t.eval_interval and iteration % t.eval_interval == 0:
            run_evaluation(run, metrics, iteration)
        after_step(run, iteration)
    for chunk in run.model_chunks:  # whoever reads parameters next gets the gathered ones
        chunk.finish_param_sync()
    checkpoint.at_train_end(run)
    elapsed = time.perf_counter() - start
    return {"summary": True, "iterations": state.iteration,
            "final_lm_loss": losses.get("lm loss"),
            "tokens_per_sec": throughput.tokens / max(elapsed, 1e-9), "time_s": elapsed,
            "consumed_samples": state.consumed_samples}


def run_evaluation(run: Run, metrics: MetricsLogger, iteration: int) -> None:
    loss = evaluate(run)
    if loss is not None:
        metrics.evaluation({"iteration": iteration, "valid_lm_loss": loss})


def after_step(run: Run, iteration: int) -> None:
    """Per-iteration work after the step (checkpoints hook in here)."""
    checkpoint.after_step(run, iteration)


def pretrain(config: TrainConfig, extra_plugins=(), world: WorldInfo | None = None) -> dict:
    """Build everything for this rank and train; returns the summary record."""
    run = setup(config, extra_plugins, world)
    checkpoint.load_if_requested(run)
    metrics = MetricsLogger(config, run.world.rank, run.state.iteration)
    try:
        summary = train(run, metrics)
        t = config.training
        if t.eval_interval and run.state.iteration % t.eval_interval != 0:
            run_evaluation(run, metrics, run.state.iteration)
        metrics.summary(summary)
        run.pm.hook.plugtron_train_end(config=config, state=run.state, summary=summary)
        return summary
    finally:
        checkpoint.close(run)
        metrics.close()
