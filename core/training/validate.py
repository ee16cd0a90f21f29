"""Checks on a whole configuration, run before any rank is launched where possible.

Each failure names the values and the rule, so the user can fix the command line.
"""

from __future__ import annotations

from plugtron.core.config import TrainConfig, derive_padded_vocab_size, validate_tensor_parallel
from plugtron.core.contracts.model_info import model_info_for
from plugtron.core.errors import ConfigError
from plugtron.core.monitoring.profiling import validate_profile
from plugtron.core.monitoring.replicas import validate_replica_check
from plugtron.core.monitoring.straggler import validate_straggler
from plugtron.core.parallel.context import V_SHAPE, check_placement, validate_sizes
from plugtron.core.parallel.context_parallel import check_support
from plugtron.core.pipeline.layout import chunk_layers
from plugtron.core.pipeline.plan import check_schedule, placement_of
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import shards_layer_wise, wants_sharded_gradients
from plugtron.core.plugins.objects import call_declared, run_plugin_objects
from plugtron.core.plugins.selection import derive_driver_names, resolve_schedule
from plugtron.core.training.recompute import validate_recompute
from plugtron.core.training.rerun import validate_rerun


def _positive(name: str, value) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")


def validate(config: TrainConfig, world_size: int) -> None:

    m, p, t = config.model, config.parallel, config.training
    size: int | None
    for name, size in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--seq-length", m.seq_length), ("--micro-batch-size", t.micro_batch_size),
                        ("--global-batch-size", t.global_batch_size),
                        ("--train-iters", t.train_iters), ("--ddp-bucket-size", p.ddp_bucket_size)):
        _positive(name, size)
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    _refuse_unbuilt(config)
    derive(config)
    validate_sizes(world_size, tp, pp, cp, p.expert_model_parallel_size,
                   p.expert_tensor_parallel_size, p.virtual_pipeline_model_parallel_size)
    dp = world_size // (tp * pp * cp)
    validate_tensor_parallel(config, tp)
    for name, fraction in (("--hidden-dropout", m.hidden_dropout),
                           ("--label-smoothing", m.label_smoothing)):
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {fraction}")

    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {t.global_batch_size} must be a multiple of "
                          f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp} "
                          f"= {t.micro_batch_size * dp}")
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; choose one")
    if t.qk_clip:
        _check_qk_clip(config)
    _check_data_parallel(config)
    if t.lr < 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"need 0 <= --min-lr ({t.min_lr}) <= --lr ({t.lr})")
    if t.eval_interval < 0 or t.eval_iters < 0:
        raise ConfigError("--eval-interval and --eval-iters must be >= 0")
    if config.data.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0 (0: load in the main thread), got "
                          f"{config.data.num_workers}")

    vp = p.virtual_pipeline_model_parallel_size
    if not _model_places_layers(config):
        for rank in range(pp):
            for stage in range(vp or 1):
                chunk_layers(m.num_layers, pp, rank, vp, stage if vp else None,
                             p.decoder_first_pipeline_num_layers,
                             p.decoder_last_pipeline_num_layers, p.pipeline_placement)
    check_pipeline_schedule(config, dp)
    if config.checkpoint.save_interval is not None and not config.checkpoint.save:
        raise ConfigError("--save-interval needs --save DIR")
    _check_finetune(config)

    validate_profile(config)
    validate_straggler(config)
    validate_rerun(config)
    validate_replica_check(config)
    if config.training.skip_nonfinite_steps < 0:
        raise ConfigError(f"--skip-nonfinite-steps must be >= 0 (0: stop at the first), got "
                          f"{config.training.skip_nonfinite_steps}")
    validate_recompute(config)
    validate_plugins(config, world_size)


#: Parallel dimensions whose flags exist (Megatron's names) but whose machinery is not built
#: yet: refused rather than accepted and ignored.
NOT_YET_SUPPORTED: tuple = ()


def derive(config: TrainConfig) -> None:
    """Everything the settings imply, in one place (before the checks that read it): the
    plugins chosen for ``auto``, the schedule's placement (and ``--vp`` 2 for a V shape), the
    padded vocabulary where the vocabulary is known. Idempotent; after validation the CLI
    freezes the config (core/config_freeze.py), so nothing derives it again differently."""
    derive_driver_names(config)
    apply_schedule_placement(config)
    m = config.model
    if m.vocab_size is not None and m.make_vocab_size_divisible_by >= 1:  # else refused below
        derive_padded_vocab_size(config, config.parallel.tensor_model_parallel_size)


def apply_schedule_placement(config: TrainConfig, schedule=None) -> str:
    """Ask the run's schedule (``schedule``: its plugin object or a plugin manager's ``hook``;
    default: load it) where its virtual stages live, and fix the config to that: a V-shape
    placement has two chunks per rank, so ``--vp`` left out becomes 2. Idempotent."""
    p = config.parallel
    if schedule is None:
        schedule = registry.instantiate(registry.load("schedule", resolve_schedule(config)))
    placement = placement_of(schedule, p.pipeline_model_parallel_size, config)
    if placement == V_SHAPE and p.virtual_pipeline_model_parallel_size is None:
        p.virtual_pipeline_model_parallel_size = 2
    check_placement(placement, p.pipeline_model_parallel_size,
                    p.virtual_pipeline_model_parallel_size or 1)
    p.pipeline_placement = placement
    return placement


def _check_finetune(config: TrainConfig) -> None:
    c = config.checkpoint
    if c.finetune and not c.pretrained_checkpoint:
        raise ConfigError("--finetune needs --pretrained-checkpoint PATH: the checkpoint whose "
                          "model weights the fine-tune starts from")
    if c.pretrained_checkpoint and not c.finetune:
        raise ConfigError(f"--pretrained-checkpoint {c.pretrained_checkpoint}: add --finetune "
                          f"(its model weights only, at iteration 0, with a fresh optimizer)")


def _refuse_unbuilt(config: TrainConfig) -> None:
    for name, flag in NOT_YET_SUPPORTED:
        value = getattr(config.parallel, name)
        if value is not None and value != 1:
            raise ConfigError(f"{flag} {value}: not supported yet (only 1); plugtron does not "
                              f"accept a flag that would change nothing")


def _model_places_layers(config: TrainConfig) -> bool:
    """Whether the selected model splits its layers over stages itself (``ModelInfo``)."""

    return model_info_for(config).places_layers


def validate_plugins(config: TrainConfig, world_size: int, plugins=None) -> None:
    """Every plugin's own checks (``plugtron_validate``) on the whole config."""

    plugins = run_plugin_objects(config, strict_drivers=True) if plugins is None else plugins
    _check_context_parallel(config, plugins)
    for plugin in plugins:
        call_declared(plugin, "plugtron_validate", config=config, world_size=world_size)


def _check_qk_clip(config: TrainConfig) -> None:
    t = config.training
    if not (0.0 < t.qk_clip_alpha < 1.0 and t.qk_clip_threshold > 0.0):
        raise ConfigError(f"--qk-clip needs 0 < --qk-clip-alpha < 1 and --qk-clip-threshold > 0, "
                          f"got {t.qk_clip_alpha} and {t.qk_clip_threshold}")
    # A sharding optimizer's fp32 master copies live on one rank each: the others could not
    # scale their bf16 weights to the same rounding.
    if (t.bf16 or t.fp16) and (wants_sharded_gradients(config) or shards_layer_wise(config)):
        raise ConfigError("--qk-clip with --bf16/--fp16 and a sharded optimizer "
                          "(--use-distributed-optimizer) is not offered: use fp32, or an "
                          "optimizer that keeps whole master copies")


def _check_context_parallel(config: TrainConfig, plugins) -> None:
    """With --cp > 1: sizes and comm type, and the selected model and layer backend declare cp
    support (core/parallel/context_parallel.py); the model checks its own layer types."""

    roles = {p.role: p.obj for p in plugins}
    check_support(config, model=roles.get("model"), layer_backend=roles.get("layer_backend"))


def _check_data_parallel(config: TrainConfig) -> None:
    """Distributed-optimizer and fp16 loss-scaler settings (docs/data_parallel.md)."""

    # --overlap-param-gather and the sharding strategy are the data-parallel wrapper's and the
    # selectors' to check (plugins/data_parallel/, plugins/selectors/).
    t = config.training
    if t.fp16:
        if t.initial_loss_scale <= 0 or t.min_loss_scale <= 0:
            raise ConfigError(f"--initial-loss-scale ({t.initial_loss_scale}) and "
                              f"--min-loss-scale ({t.min_loss_scale}) must be positive")
        if t.loss_scale_window < 1 or t.hysteresis < 1:
            raise ConfigError(f"--loss-scale-window ({t.loss_scale_window}) and --hysteresis "
                              f"({t.hysteresis}) must be at least 1")


def check_pipeline_schedule(config: TrainConfig, dp: int) -> None:
    """The selected schedule must support the layout and the number of microbatches (e.g.
    interleaving's group-size rules); its lists must finish. Nothing is launched."""

    p, t = config.parallel, config.training
    name = resolve_schedule(config)
    schedule = registry.instantiate(registry.load("schedule", name))
    if p.microbatch_group_size_per_vp_stage is not None:
        _positive("--microbatch-group-size-per-vp-stage", p.microbatch_group_size_per_vp_stage)
    check_schedule(schedule.schedule_actions, p.pipeline_model_parallel_size,
                   p.virtual_pipeline_model_parallel_size or 1,
                   t.global_batch_size // (t.micro_batch_size * dp), config,
                   p.pipeline_placement)
