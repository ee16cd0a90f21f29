"""Checks on a whole configuration, run before any rank is launched where possible.

Each failure names the values and the rule, so the user can fix the command line.
"""

from __future__ import annotations

from .config import TrainConfig
from .errors import ConfigError
from .pipeline_layout import chunk_layers


def _positive(name: str, value) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")


def validate(config: TrainConfig, world_size: int) -> None:
    from .parallel_context import validate_sizes

    m, p, t = config.model, config.parallel, config.training
    for name, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads),
                        ("--seq-length", m.seq_length), ("--micro-batch-size", t.micro_batch_size),
                        ("--global-batch-size", t.global_batch_size),
                        ("--train-iters", t.train_iters), ("--ddp-bucket-size", p.ddp_bucket_size),
                        ("--num-query-groups", m.num_query_groups),
                        ("--ffn-hidden-size", m.ffn_hidden_size)):
        _positive(name, value)
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    validate_sizes(world_size, tp, pp, cp, p.expert_model_parallel_size,
                   p.expert_tensor_parallel_size, p.virtual_pipeline_model_parallel_size)
    dp = world_size // (tp * pp * cp)

    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    if heads % groups:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by "
                          f"--num-query-groups {groups}")
    if m.kv_channels is None and m.hidden_size % heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by "
                          f"--num-attention-heads {heads} (or give --kv-channels)")
    validate_tensor_parallel(config, tp)
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"--max-position-embeddings {m.max_position_embeddings} is smaller "
                          f"than --seq-length {m.seq_length}")
    for name, value in (("--hidden-dropout", m.hidden_dropout),
                        ("--attention-dropout", m.attention_dropout),
                        ("--label-smoothing", m.label_smoothing)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value}")

    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {t.global_batch_size} must be a multiple of "
                          f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp} "
                          f"= {t.micro_batch_size * dp}")
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; choose one")
    _check_data_parallel(config)
    if t.lr < 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"need 0 <= --min-lr ({t.min_lr}) <= --lr ({t.lr})")
    if t.eval_interval < 0 or t.eval_iters < 0:
        raise ConfigError("--eval-interval and --eval-iters must be >= 0")

    vp = p.virtual_pipeline_model_parallel_size
    for rank in range(pp):
        for stage in range(vp or 1):
            chunk_layers(m.num_layers, pp, rank, vp, stage if vp else None,
                         p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)
    check_pipeline_schedule(config, dp)
    if config.checkpoint.save_interval is not None and not config.checkpoint.save:
        raise ConfigError("--save-interval needs --save DIR")


def validate_tensor_parallel(config: TrainConfig, tp: int | None = None) -> None:
    """Sizes that tensor (and sequence) parallelism split: each must divide by tp, so every tp
    rank holds whole heads, whole query groups and equal slices. Also run by the layer backend,
    so in-process runs fail here before any layer is built."""
    m, p = config.model, config.parallel
    tp = p.tensor_model_parallel_size if tp is None else tp
    cp = p.context_parallel_size
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    if heads % tp:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --tp {tp}: each "
                          f"tensor-parallel rank needs whole attention heads")
    if groups % tp:
        raise ConfigError(f"--num-query-groups {groups} is not divisible by --tp {tp}: each "
                          f"tensor-parallel rank needs whole key/value groups (use a multiple "
                          f"of {tp} query groups, or a smaller --tp)")
    if m.hidden_size % tp:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --tp {tp}")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp:
        raise ConfigError(f"--ffn-hidden-size {ffn} is not divisible by --tp {tp}")
    if m.make_vocab_size_divisible_by < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by must be at least 1, got "
                          f"{m.make_vocab_size_divisible_by}")
    if m.vocab_size is not None and m.vocab_size < 1:
        raise ConfigError(f"--vocab-size must be at least 1, got {m.vocab_size}")
    if m.padded_vocab_size is not None and m.padded_vocab_size % tp:
        raise ConfigError(f"the padded vocabulary {m.padded_vocab_size} is not divisible by "
                          f"--tp {tp} (it is padded to a multiple of "
                          f"--make-vocab-size-divisible-by x tp)")
    if p.sequence_parallel and tp > 1 and m.seq_length % (tp * cp):
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --tp {tp} x --cp "
                          f"{cp} = {tp * cp}, which --sequence-parallel needs (each tp rank "
                          f"holds an equal slice of the sequence)")


def _check_data_parallel(config: TrainConfig) -> None:
    """Distributed-optimizer and fp16 loss-scaler settings (docs/data_parallel.md)."""
    from .errors import PluginError

    p, t = config.parallel, config.training
    if p.overlap_param_gather:
        from .plugin_manager import wants_sharded_gradients

        try:
            sharded = wants_sharded_gradients(config)
        except PluginError:
            sharded = True  # an unknown optimizer is reported by the plugin check
        if not sharded:
            raise ConfigError("--overlap-param-gather needs a sharding optimizer: add "
                              "--use-distributed-optimizer (or --optimizer distributed-adam)")
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
    from . import registry
    from .plugin_manager import resolve_schedule
    from .schedule_plan import check_schedule

    p, t = config.parallel, config.training
    name = resolve_schedule(config)
    schedule = registry.instantiate(registry.load("schedule", name))
    if p.microbatch_group_size_per_vp_stage is not None:
        _positive("--microbatch-group-size-per-vp-stage", p.microbatch_group_size_per_vp_stage)
    check_schedule(schedule.schedule_actions, p.pipeline_model_parallel_size,
                   p.virtual_pipeline_model_parallel_size or 1,
                   t.global_batch_size // (t.micro_batch_size * dp), config)
