"""One training run: pretrain -> train -> train_step (DESIGN section 4)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import pluggy
import torch
from plugtron.core import checkpoint
from plugtron.core.blocks.cpu_allocator import keep_freed_memory
from plugtron.core.blocks.qk_clip import clip_qk
from plugtron.core.checkpoint import dir_lock
from plugtron.core.checkpoint.saver import Checkpointer
from plugtron.core.config import TrainConfig, derive_padded_vocab_size, num_microbatches
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.contracts.data_parallel import DataParallelChunk
from plugtron.core.contracts.layer_backend import LayerBackend
from plugtron.core.contracts.loss import bind_loss_closure, run_loss_func
from plugtron.core.contracts.model_info import ModelInfo, metric_name
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.monitoring import run_status
from plugtron.core.monitoring.memory import step_memory_mb
from plugtron.core.monitoring.metrics import MetricsLogger, Throughput
from plugtron.core.monitoring.profiling import StepProfiler
from plugtron.core.monitoring.replicas import check_replicas
from plugtron.core.monitoring.straggler import StragglerLog
from plugtron.core.parallel import comm, shared_params
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.context_parallel import check_built_layers, local_microbatches
from plugtron.core.parallel.distributed import WorldInfo, elastic_restart_count, init_distributed
from plugtron.core.parallel.random import seed_everything
from plugtron.core.pipeline.executor import ensure_forward_backward
from plugtron.core.pipeline.p2p import P2PCommunicator
from plugtron.core.pipeline.plan import check_schedule
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import build_plugin_manager, wants_sharded_gradients
from plugtron.core.plugins.options import with_plugin_sections
from plugtron.core.plugins.selection import resolve_data_parallel, resolve_schedule, selected_driver
from plugtron.core.training import aux_losses, data, grads, preemption, step_info
from plugtron.core.training.builder import build_model, model_dtype
from plugtron.core.training.lr_schedule import LRScheduler
from plugtron.core.training.optimizer import Optimizer, StepResult, checked_optimizer
from plugtron.core.training.rerun import NonFiniteSteps, RerunStateMachine
from plugtron.core.training.state import TrainState
from plugtron.core.training.validate import apply_schedule_placement, validate_plugins


@dataclass
class Run:
    """Everything one rank built for a run."""

    config: TrainConfig
    world: WorldInfo
    parallel: ParallelContext
    pm: pluggy.PluginManager
    backend: LayerBackend
    model_chunks: list[DataParallelChunk]
    optimizer: Optimizer
    scheduler: LRScheduler
    datasets: tuple
    p2p: P2PCommunicator | None = None
    checkpointer: Checkpointer | None = None  # made on first use
    state: TrainState = field(default_factory=TrainState)
    info: ModelInfo = field(default_factory=ModelInfo)
    #: The pipeline's agreed report keys of the training step (core.training.reduce_reports).
    report_keys: dict = field(default_factory=dict)
    #: Seconds this rank spent in the last step's forward and backward (the schedule).
    forward_backward_s: float = 0.0
    #: --rerun-mode validate_results (core/training/rerun.py); made by setup.
    rerun: RerunStateMachine | None = None
    #: The base checkpoint a fine-tune started from (core/checkpoint/base.py), once loaded.
    base_checkpoint: dict | None = None

    @property
    def num_microbatches(self) -> int:
        return num_microbatches(self.config, self.parallel.dp_size)

    def forward_step_func(self, data_iterator, model):
        """The run's ``forward_step`` hook, its loss closure bound to the run's ``loss_func``
        hook (so that every wrapper of either runs)."""
        with run_loss_func(self.pm.hook.loss_func):
            output, closure = self.pm.hook.forward_step(data_iterator=data_iterator, model=model)
        return output, bind_loss_closure(closure, self.pm.hook.loss_func)


def build_parallel(config: TrainConfig, world: WorldInfo) -> ParallelContext:
    p = config.parallel
    return ParallelContext.build(
        world.world_size, world.rank, tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size, vp=p.virtual_pipeline_model_parallel_size,
        cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size, device=world.device, placement=p.pipeline_placement)


def split_sizes(config: TrainConfig) -> tuple[int, int, int]:
    t = config.training
    return (t.train_iters * t.global_batch_size, t.eval_iters * t.global_batch_size,
            t.eval_iters * t.global_batch_size)


def finalize_model_config(config: TrainConfig, parallel: ParallelContext) -> None:
    derive_padded_vocab_size(config, parallel.tp_size)


def build_model_chunks(config, pm, backend, parallel, device) -> list:
    """The rank's model chunks, as the model transforms leave them, each wrapped by the run's
    data-parallel plugin (hook ``wrap_model_chunk``), which decides the dtype the parameters
    are kept in."""
    sharded = wants_sharded_gradients(config, pm)
    chunks = []
    for module in build_model(config, parallel, plugins=pm, layer_backend=backend):
        module.to(device=device)
        chunks.append(checked_chunk(pm.hook.wrap_model_chunk(
            config=config, module=module, parallel=parallel, shard_gradients=sharded), config))
    shared_params.check_placement(chunks, parallel)
    check_built_layers(chunks, parallel)
    return chunks


def checked_chunk(chunk, config) -> DataParallelChunk:
    """What ``wrap_model_chunk`` returned, if it follows ``DataParallelChunk``; else a
    ``PluginError`` naming the wrapper and what is missing."""
    if isinstance(chunk, DataParallelChunk):
        return chunk
    missing = sorted(name for name in ("module", "sharded", "grad_shard_groups",
                                       "defers_weight_grads", "set_input_tensor", "no_sync",
                                       "start_grad_sync", "finish_grad_sync", "scale_grads",
                                       "zero_grad_buffer", "start_param_sync",
                                       "finish_param_sync") if not hasattr(chunk, name))
    raise PluginError(f"data-parallel wrapper {resolve_data_parallel(config)!r}: "
                      f"wrap_model_chunk returned {type(chunk).__qualname__}, which lacks "
                      f"{', '.join(missing) or 'the protocol'} of plugtron.api.DataParallelChunk")


def _name_undeferred_layers(model_chunks) -> None:
    """Under a split-backward schedule, say which layers compute their weight gradients at
    ``I`` (exact, but they do not fill the bubble)."""
    if not all(getattr(chunk, "defers_weight_grads", True) for chunk in model_chunks):
        print(f"note: split backward: the data-parallel wrapper "
              f"{type(model_chunks[0]).__qualname__} reduces gradients inside backward, so "
              f"every weight gradient is computed at I, not deferred to W", flush=True)
        return
    found = wgrad.weight_grads_at_input(m for chunk in model_chunks for m in chunk.modules())
    if found:
        print("note: split backward: weight gradients computed at I, not deferred to W: "
              + "; ".join(f"{name} ({why})" for name, why in sorted(found.items())), flush=True)


def setup(config: TrainConfig, extra_plugins=(), world: WorldInfo | None = None,
          schedule=None) -> Run:
    """Build everything one rank needs. ``world`` defaults to the torchrun/initialised world.
    ``schedule``: a schedule plugin object that takes the place of the driver the config
    selects (the testing kit's way to run a schedule that is not installed)."""
    world = world or init_distributed()
    if world.device.type == "cpu":
        keep_freed_memory()  # the step's tensors come back without page faults each step
    with_plugin_sections(config)  # a config built in Python may not carry them yet
    validate_plugins(config, world.world_size)
    pm = build_plugin_manager(config, extra_plugins)
    # Module state of the losses added inside a model: an earlier run in this process (fp16's
    # loss scale) must not scale this one's terms.
    aux_losses.take()
    aux_losses.set_loss_scale(1.0)
    if schedule is not None:
        pm.unregister(name=f"schedule:{resolve_schedule(config)}")
        pm.register(schedule)
    apply_schedule_placement(config, pm.hook)
    parallel = build_parallel(config, world)
    step_info.current.rank = world.rank
    ensure_forward_backward(pm)
    pm.hook.plugtron_configure.call_historic(kwargs={"config": config})
    pm.hook.plugtron_process_groups_ready.call_historic(kwargs={"parallel": parallel})
    # A schedule that cannot run this layout fails now, not at the first step.
    plan = check_schedule(pm.hook.schedule_actions, parallel.pp_size, parallel.vp_size or 1,
                          num_microbatches(config, parallel.dp_size), config,
                          parallel.pipeline_placement)
    seed_everything(config.training.seed, parallel)

    datasets = pm.hook.dataset_provider(config=config, split_sizes=split_sizes(config),
                                        parallel=parallel)
    finalize_model_config(config, parallel)
    backend_cls = registry.load("layer_backend", selected_driver(config, "layer_backend"))
    backend = backend_cls(config, parallel)

    model_chunks = build_model_chunks(config, pm, backend, parallel, world.device)
    if world.rank == 0 and any(a.kind == "I" for actions in plan for a in actions):
        _name_undeferred_layers(model_chunks)
    pm.hook.plugtron_model_built(config=config, model_chunks=model_chunks, parallel=parallel)
    optimizer = checked_optimizer(pm.hook.build_optimizer(
        config=config, model_chunks=model_chunks, parallel=parallel), config)
    scheduler = LRScheduler.from_config(optimizer, config)
    p2p = None
    if parallel.pp_size > 1:
        p2p = P2PCommunicator.from_config(config, parallel, model_dtype(config), world.device)
    info = pm.hook.model_info(config=config)
    return Run(config, world, parallel, pm, backend, model_chunks, optimizer, scheduler,
               tuple(datasets), p2p, info=info if isinstance(info, ModelInfo) else ModelInfo(),
               rerun=RerunStateMachine(config, parallel, getattr(backend, "rng_tracker", None)))


# --------------------------------------------------------------------------- the step


def data_iterators(run: Run, dataset, consumed_samples: int, timers: list | None = None) -> list:
    """One iterator per model chunk, all at the same position (interleaving draws each chunk's
    microbatches in its own order). ``timers`` receives each chunk's ``TimedIterator`` (the
    step's data time)."""
    mbs = run.config.training.micro_batch_size
    workers = run.config.data.num_workers
    out = []
    for _ in run.model_chunks:
        timed = data.TimedIterator(data.microbatch_iterator(
            dataset, mbs, run.parallel.dp_rank, run.parallel.dp_size, consumed_samples,
            num_workers=workers))
        source = timed
        if timers is not None:
            timers.append(timed)
            if run.rerun is not None:  # training: a step may be re-run on the same data
                source = run.rerun.wrap(timed)
        # ``recording``: each drawn microbatch sets the token weight of losses added inside the
        # model (core/training/aux_losses.py). ``local_microbatches``: every cp rank of a dp rank draws
        # the same samples and keeps its sequence chunks (core/parallel/context_parallel.py).
        out.append(aux_losses.recording(local_microbatches(source, run.parallel,
                                                           run.config.model.seq_length)))
    return out


def _report_pair(value) -> torch.Tensor:
    """A report value as ``[sum, count]``: a 2-element tensor or a pair; a lone number counts
    once (a plain mean over microbatches)."""
    if isinstance(value, (list, tuple)):
        value = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in value])
    value = torch.as_tensor(value).detach().to("cpu", torch.float64).reshape(-1)
    if value.numel() == 1:
        return torch.stack([value[0], torch.ones((), dtype=torch.float64)])
    if value.numel() != 2:
        raise ConfigError(f"a loss report value must be a scalar or [sum, count], got "
                          f"{value.numel()} numbers")
    return value


def _agreed_keys(local: list[tuple], parallel: ParallelContext) -> list[tuple]:
    """The union of ``(kind, key)`` over the pipeline: every stage takes part in the reduction,
    but only the last stage has the loss reports and each stage its own added losses."""
    if parallel.pp_size == 1:
        return list(local)
    gathered: list[list[tuple]] = [[] for _ in range(parallel.pp_size)]
    torch.distributed.all_gather_object(gathered, list(local), group=parallel.pp_group)
    return sorted({tuple(k) for keys in gathered for k in keys})


def _reduced_totals(keys, reports, added, parallel, changed: bool) -> torch.Tensor:
    """``[sum, count]`` rows of ``keys`` and a last row ``[changed flag, token count]``, summed
    over data-parallel ranks and the pipeline."""
    totals = torch.zeros(len(keys) + 1, 2, dtype=torch.float64)
    for report in reports:
        for i, (kind, key) in enumerate(keys):
            if kind == "report" and key in report:
                totals[i] += _report_pair(report[key])
        totals[-1, 1] += float(report["num_tokens"])
    for i, (kind, key) in enumerate(keys):
        if kind == "added" and key in added:
            totals[i, 0] += float(added[key])
    totals[-1, 0] = float(changed)
    comm.all_reduce(totals, parallel.dp_cp_group)
    comm.all_reduce(totals, parallel.pp_group)
    return totals


def reduce_reports(reports: list[dict], parallel: ParallelContext,
                   added: dict | None = None, cache: dict | None = None) -> dict[str, float]:
    """Token-weighted means of every ``[sum, count]`` report key over microbatches, data-parallel
    ranks and (from the last stage) the whole pipeline; losses added inside the model
    (``added``: ``{name: sum of n_m x value}`` on this rank) are divided by the global token
    count.

    ``cache`` (a dict kept by the caller between steps): the pipeline's agreed key list is
    gathered once (an ``all_gather_object``, pickling, two collectives) and reused; a rank whose
    own key set changed raises a flag in the reduction itself, and then every rank agrees
    again and reduces again, so the collectives stay in step without a gather per step."""
    added = added or {}
    local = sorted(set([("report", k) for r in reports for k in r if k != "num_tokens"]
                       + [("added", k) for k in added]))
    if cache is not None and "keys" in cache:
        keys = cache["keys"]
        totals = _reduced_totals(keys, reports, added, parallel, local != cache["own_keys"])
        if totals[-1, 0] == 0:
            return _means(keys, totals)
    keys = _agreed_keys(local, parallel)
    if cache is not None:
        cache.update(keys=keys, own_keys=local)
    return _means(keys, _reduced_totals(keys, reports, added, parallel, False))


def _means(keys, totals) -> dict[str, float]:
    tokens = totals[-1, 1].clamp(min=1)
    out = {}
    for i, (kind, key) in enumerate(keys):
        count = tokens if kind == "added" else totals[i, 1].clamp(min=1)
        out[key] = (totals[i, 0] / count).item()
    return out


def loss_metrics(losses: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Report keys as metrics-file keys (``"lm loss"`` -> ``"lm_loss"``)."""
    return {prefix + metric_name(k): v for k, v in losses.items()}


def run_schedule(run: Run, iterators, forward_only: bool) -> list[dict]:
    chunks_iter = iterators if len(iterators) > 1 else iterators[0]
    aux_losses.set_loss_scale(run.optimizer.loss_scale())
    return run.pm.hook.forward_backward(
        forward_step_func=run.forward_step_func, data_iterator=chunks_iter,
        model=run.model_chunks, num_microbatches=run.num_microbatches,
        seq_length=run.config.model.seq_length,
        micro_batch_size=run.config.training.micro_batch_size, forward_only=forward_only,
        parallel=run.parallel, config=run.config, p2p=run.p2p,
        loss_scale=run.optimizer.loss_scale())


def forward_backward(run: Run, iterators) -> tuple[list[dict], dict]:
    """One step's forward and backward over every microbatch, gradients reduced and ready for
    the optimizer: the step's reports and the losses added inside the model."""
    run.optimizer.zero_grad()
    for chunk in run.model_chunks:  # after the optimizer: it may point .grad into the buffers
        chunk.zero_grad_buffer()
    aux_losses.take()  # nothing left over from an evaluation or a failed step
    schedule_start = time.perf_counter()
    reports = run_schedule(run, iterators, forward_only=False)
    run.forward_backward_s = time.perf_counter() - schedule_start
    added = aux_losses.take()
    num_tokens = torch.zeros((), dtype=torch.float32)
    for report in reports:
        num_tokens += report["num_tokens"].float().cpu()
    grads.finalize_model_grads(run.model_chunks, run.parallel, num_tokens)
    return reports, added


def train_step(run: Run, iterators) -> tuple[dict, StepResult]:
    rerun = run.rerun
    if rerun is None or not rerun.enabled:
        reports, added = forward_backward(run, iterators)
        result = optimizer_step(run)
        return reduce_reports(reports, run.parallel, added, run.report_keys), result
    # --rerun-mode validate_results: the result is checked before the optimizer step, and a
    # suspicious step runs once more on the same microbatches from the same RNG state.
    rerun.start_step()
    try:
        while True:
            reports, added = forward_backward(run, iterators)
            losses = reduce_reports(reports, run.parallel, added, run.report_keys)
            if not rerun.verdict(losses.get(run.info.main_loss), run.model_chunks):
                break
    finally:
        rerun.end_step()
    if rerun.error is not None:  # reported with the step's record, then the run stops
        return losses, StepResult(False, math.nan, None)
    return losses, optimizer_step(run)


def optimizer_step(run: Run) -> StepResult:
    """The optimizer's step; when it changed the parameters, every chunk's
    ``start_param_sync()`` (the data-parallel wrapper brings the new values to the ranks that
    compute with them: ``ddp``'s gather of sharded buffers, ``fsdp2``'s reshard, a third
    party's averaging), whatever the optimizer."""
    result = run.optimizer.step()
    if result.stepped:
        for chunk in run.model_chunks:
            chunk.start_param_sync()
        t = run.config.training
        if t.qk_clip:  # on the parameters every rank now holds (the gathers done)
            for chunk in run.model_chunks:
                chunk.finish_param_sync()
            result.max_attention_logit = clip_qk(run.model_chunks, run.optimizer, run.parallel,
                                                 t.qk_clip_threshold, t.qk_clip_alpha)
    return result


def evaluate_all(run: Run) -> dict[str, float] | None:
    """Every report key (and added loss) over ``--eval-iters`` validation batches; ``None``
    without a validation split."""
    valid = run.datasets[1] if len(run.datasets) > 1 else None
    if valid is None or run.config.training.eval_iters == 0:
        return None
    for chunk in run.model_chunks:
        chunk.eval()
    reports = []
    aux_losses.take()
    iterators = data_iterators(run, valid, 0)
    try:
        for _ in range(run.config.training.eval_iters):
            reports += run_schedule(run, iterators, forward_only=True)
    except StopIteration:
        pass  # a validation split smaller than eval_iters batches: use what there is
    finally:
        for chunk in run.model_chunks:
            chunk.train()
    return reduce_reports(reports, run.parallel, aux_losses.take())


def evaluate(run: Run) -> float | None:
    """The validation value of the model's main loss."""
    losses = evaluate_all(run)
    return None if losses is None else losses.get(run.info.main_loss)


def train(run: Run, metrics: MetricsLogger) -> dict:
    config, state = run.config, run.state
    t = config.training
    tokens_per_iter = t.global_batch_size * config.model.seq_length
    timers: list = []
    iterators = data_iterators(run, run.datasets[0], state.consumed_samples, timers)
    run.pm.hook.plugtron_train_start(config=config, state=state)
    throughput = Throughput()
    profiler = StepProfiler(config, run.world.rank)
    stragglers = StragglerLog(config, run.world.device)
    nonfinite = NonFiniteSteps(config)
    check_replicas(run, state.iteration, at_start=True)
    losses: dict = {}
    start = time.perf_counter()
    while state.iteration < t.train_iters:
        iteration = state.iteration + 1
        step_info.current.iteration = iteration
        run_status.set_phase(f"step {iteration}")
        lr = run.scheduler.prepare(iteration)
        profiler.before_step(iteration)
        step_start = time.perf_counter()
        try:
            losses, result = train_step(run, iterators)
        except StopIteration:
            raise ConfigError(f"the training data ran out at iteration {iteration}; the dataset "
                              f"is smaller than --train-iters x --global-batch-size") from None
        step_time = time.perf_counter() - step_start
        check_replicas(run, iteration)
        profiler.after_step(iteration)
        stragglers.add(run.forward_backward_s)
        state.iteration = iteration
        state.consumed_samples += t.global_batch_size
        record = {"iteration": iteration, **loss_metrics(losses),
                  "grad_norm": result.grad_norm, "lr": lr,
                  "tokens_per_sec": throughput.add(tokens_per_iter), "step_time_s": step_time,
                  "data_time_s": sum(timer.take_wait() for timer in timers),
                  "consumed_samples": state.consumed_samples, "skipped": not result.stepped,
                  "memory_mb": step_memory_mb(run.world.device)}
        if result.num_zeros is not None:
            record["num_zeros"] = result.num_zeros
        if result.max_attention_logit is not None:
            record["max_attention_logit"] = result.max_attention_logit
        if hasattr(run.optimizer, "current_loss_scale"):
            record["loss_scale"] = run.optimizer.current_loss_scale()
        record.update(stragglers.report(iteration))  # every rank: a gather when due
        if run.rerun is not None:
            record.update(run.rerun.report)
        try:
            record.update(nonfinite.record(iteration, result, losses))
        finally:
            metrics.train_step(record)  # the refused step is logged before the run stops
        run.pm.hook.plugtron_step_end(iteration=iteration, metrics=record)
        if run.rerun is not None:
            run.rerun.stop()  # a reproducible NaN/Inf: an error, once the record says so
        # A signal or exit limit stops the run after this step. On a signal (a scheduler's
        # deadline) nothing but the checkpoint follows: no validation, no interval save (the
        # end-of-training save below writes this iteration).
        stopping = preemption.check(run, iteration)
        if t.eval_interval and iteration % t.eval_interval == 0 and not preemption.by_signal():
            run_evaluation(run, metrics, iteration)
        if not stopping:
            after_step(run, iteration)
        if stopping:
            break
    profiler.finish()
    for chunk in run.model_chunks:  # whoever reads parameters next gets the gathered ones
        chunk.finish_param_sync()
    checkpoint.at_train_end(run)
    elapsed = time.perf_counter() - start
    main = run.info.main_loss
    return {"summary": True, "iterations": state.iteration, "main_loss": metric_name(main),
            "final_loss": losses.get(main), f"final_{metric_name(main)}": losses.get(main),
            "tokens_per_sec": throughput.tokens / max(elapsed, 1e-9), "time_s": elapsed,
            "consumed_samples": state.consumed_samples}


def run_evaluation(run: Run, metrics: MetricsLogger, iteration: int) -> None:
    losses = evaluate_all(run)
    if losses is not None:
        record = {"iteration": iteration, **loss_metrics(losses, "valid_")}
        metrics.evaluation(record)
        run.pm.hook.plugtron_evaluation_end(iteration=iteration, metrics=record)


def after_step(run: Run, iteration: int) -> None:
    """Per-iteration work after the step (checkpoints hook in here)."""
    checkpoint.after_step(run, iteration)


def pretrain(config: TrainConfig, extra_plugins=(), world: WorldInfo | None = None) -> dict:
    """Build everything for this rank and train; returns the summary record."""
    preemption.begin_run()
    run = setup(config, extra_plugins, world)
    # The save directory is this run's from here to the end, whichever entry point started it.
    locked = dir_lock.hold_for_run(config.checkpoint.save, run.world.rank, run.world.world_size,
                                   run.world.device)
    try:
        checkpoint.load_if_requested(run)
        return _train_and_report(run)
    finally:
        if locked and config.checkpoint.save is not None:
            dir_lock.release(config.checkpoint.save)


def _train_and_report(run: Run) -> dict:
    config = run.config
    metrics = MetricsLogger(config, run.world.rank, run.state.iteration,
                            main_loss=metric_name(run.info.main_loss))
    metrics.started(run.state.iteration, elastic_restart_count())
    try:
        summary = train(run, metrics)
        t = config.training
        if t.eval_interval and run.state.iteration % t.eval_interval != 0 and \
                not preemption.by_signal():
            run_evaluation(run, metrics, run.state.iteration)
        metrics.summary(summary)
        run.pm.hook.plugtron_train_end(config=config, state=run.state, summary=summary)
        return summary
    finally:
        checkpoint.close(run)
        metrics.close()
