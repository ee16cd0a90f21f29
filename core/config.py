"""Run configuration as dataclasses.

Every field that a user may set carries its CLI flag in its metadata (``flag``, ``aliases``,
``help``, ``choices``), so the CLI, the config-file reader and the docs share one list. Flag names
follow Megatron-LM. A config file (YAML or TOML) is flat: its keys are flag names without the
leading dashes (``num-layers: 4``) or field names (``num_layers: 4``). How flags, files and
presets set these fields: core/config_flags.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from plugtron.core.errors import ConfigError
from plugtron.core.plugins.selection import selected_driver


def opt(default: Any, flag: str, help: str, aliases: tuple[str, ...] = (), choices=None,
        is_flag: bool = False, negative: str | None = None):
    """A config field with its CLI flag (``negative`` is the flag that sets a bool to False)."""
    meta = {"flag": flag, "aliases": aliases, "help": help, "choices": choices,
            "is_flag": is_flag, "negative": negative}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class ExtensibleSection:
    """A core section that plugin sections may extend (``ConfigSection.extends``): their fields
    read and write as this section's own (``config.model.<field>``), so a model plugin keeps its
    architecture's fields where Megatron users look for them while the core declares none."""

    def __getattr__(self, name: str):
        # Only called when normal lookup fails.
        for extension in self.__dict__.get("_extensions", {}).values():
            if name in extension.__dataclass_fields__:
                return getattr(extension, name)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in type(self).__dataclass_fields__:  # type: ignore[attr-defined]
            for extension in self.__dict__.get("_extensions", {}).values():
                if name in extension.__dataclass_fields__:
                    setattr(extension, name, value)
                    return
        object.__setattr__(self, name, value)

    def extension_fields(self) -> dict[str, Any]:
        """``{field: value}`` of every extending section's fields."""
        out: dict[str, Any] = {}
        for extension in self.__dict__.get("_extensions", {}).values():
            out.update(dataclasses.asdict(extension))
        return out


@dataclass
class ModelConfig(ExtensibleSection):
    """The model fields the core reads; a model plugin extends the section with its own."""

    num_layers: int = opt(4, "--num-layers", "Number of transformer layers.")
    hidden_size: int = opt(128, "--hidden-size", "Transformer hidden size.")
    seq_length: int = opt(128, "--seq-length", "Tokens per sample.")
    vocab_size: int | None = opt(None, "--vocab-size",
                                 "Vocabulary size where the tokenizer does not fix it.")
    make_vocab_size_divisible_by: int = opt(128, "--make-vocab-size-divisible-by",
                                            "Pad the vocabulary to a multiple of this times tp.")
    normalization: str = opt("LayerNorm", "--normalization", "Norm type.",
                             choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = opt(1e-5, "--norm-epsilon", "Epsilon of the norms.")
    untie_embeddings_and_output_weights: bool = opt(
        False, "--untie-embeddings-and-output-weights",
        "Separate output layer instead of reusing the word embedding.", is_flag=True)
    hidden_dropout: float = opt(0.1, "--hidden-dropout", "Dropout after attention and MLP.")
    init_method_std: float = opt(0.02, "--init-method-std",
                                 "Std of the normal init; output projections use "
                                 "std / sqrt(2 x layers).")
    parallel_output: bool = opt(True, "--parallel-output",
                                "Keep logits vocab-sharded into the loss.", is_flag=True,
                                negative="--no-parallel-output")
    label_smoothing: float = opt(0.0, "--label-smoothing", "Label smoothing of the loss.")
    # Recorded so that an export (config.json, generation_config.json) and generation keep them;
    # an imported model takes them from its config.json.
    bos_token_id: int | None = opt(None, "--bos-token-id", "Beginning-of-sequence token id "
                                   "(default: the tokenizer's).")
    eos_token_id: int | None = opt(None, "--eos-token-id", "End-of-sequence token id "
                                   "(default: the tokenizer's eod).")
    pad_token_id: int | None = opt(None, "--pad-token-id", "Padding token id "
                                   "(default: the tokenizer's).")

    # Derived by finalize(); not flags.
    padded_vocab_size: int | None = None
    #: Plugin sections extending this one: name -> instance (``TrainConfig.add_section``).
    _extensions: dict = field(default_factory=dict, repr=False)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "--tensor-model-parallel-size",
                                          "Tensor-parallel size.", aliases=("--tp",))
    pipeline_model_parallel_size: int = opt(1, "--pipeline-model-parallel-size",
                                            "Pipeline-parallel size.", aliases=("--pp",))
    virtual_pipeline_model_parallel_size: int | None = opt(
        None, "--virtual-pipeline-model-parallel-size",
        "Model chunks per pipeline rank (interleaving).", aliases=("--vp",))
    context_parallel_size: int = opt(1, "--context-parallel-size", "Context-parallel size.",
                                     aliases=("--cp",))
    cp_comm_type: str = opt("p2p", "--cp-comm-type",
                            "How attention reaches keys on other cp ranks: p2p (ring), "
                            "allgather, or a2a (Ulysses).",
                            choices=("p2p", "allgather", "a2a"))
    expert_model_parallel_size: int = opt(1, "--expert-model-parallel-size",
                                          "Expert-parallel size.", aliases=("--ep",))
    expert_tensor_parallel_size: int | None = opt(
        None, "--expert-tensor-parallel-size",
        "Tensor-parallel size inside experts (default tp).", aliases=("--etp",))
    sequence_parallel: bool = opt(False, "--sequence-parallel",
                                  "Shard activations along the sequence outside tp regions.",
                                  is_flag=True)
    microbatch_group_size_per_vp_stage: int | None = opt(
        None, "--microbatch-group-size-per-vp-stage",
        "Microbatches run per virtual stage before moving on (default pp).")
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "--decoder-first-pipeline-num-layers", "Layers on the first pipeline stage.")
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "--decoder-last-pipeline-num-layers", "Layers on the last pipeline stage.")
    #: Where the virtual stages live, as the schedule declares (hook ``pipeline_placement``):
    #: set when the run is validated; not a flag.
    pipeline_placement: str = "looped"
    overlap_grad_reduce: bool = opt(False, "--overlap-grad-reduce",
                                    "Start bucket reductions during backward.", is_flag=True)
    overlap_param_gather: bool = opt(False, "--overlap-param-gather",
                                     "Overlap the parameter all-gather with the next forward.",
                                     is_flag=True)
    ddp_bucket_size: int | None = opt(None, "--ddp-bucket-size",
                                      "Elements per gradient bucket (default: about 40M).")
    accumulate_allreduce_grads_in_fp32: bool = opt(
        True, "--accumulate-allreduce-grads-in-fp32",
        "Accumulate and reduce gradients in fp32 under bf16/fp16.", is_flag=True,
        negative="--no-accumulate-allreduce-grads-in-fp32")
    distributed_timeout_minutes: float = opt(
        10.0, "--distributed-timeout-minutes",
        "Bound on every collective and P2P wait; on expiry the job exits naming the ranks "
        "that did not arrive.")


@dataclass
class TrainingConfig:
    micro_batch_size: int = opt(8, "--micro-batch-size", "Samples per microbatch.")
    global_batch_size: int = opt(32, "--global-batch-size",
                                        "Samples per iteration over all dp ranks "
                                        "(micro x microbatches x dp).")
    train_iters: int = opt(200, "--train-iters", "Training iterations.")
    lr: float = opt(3e-3, "--lr", "Peak learning rate.")
    min_lr: float = opt(3e-4, "--min-lr", "Learning rate at the end of decay.")
    lr_warmup_iters: int = opt(20, "--lr-warmup-iters", "Linear warmup iterations.")
    lr_decay_iters: int | None = opt(None, "--lr-decay-iters",
                                     "Iterations of decay (default train-iters).")
    lr_decay_style: str = opt("cosine", "--lr-decay-style", "Learning-rate decay.",
                              choices=("constant", "linear", "cosine"))
    weight_decay: float = opt(0.01, "--weight-decay", "Decoupled weight decay "
                              "(not on norms and biases).")
    clip_grad: float = opt(1.0, "--clip-grad", "Clip by global grad norm (0 disables).")
    qk_clip: bool = opt(False, "--qk-clip", "After each step, scale down the query and key "
                        "weights of every attention head group whose largest logit exceeded "
                        "--qk-clip-threshold (Kimi K2's MuonClip, Megatron-Core's QK-clip).",
                        is_flag=True)
    qk_clip_alpha: float = opt(0.5, "--qk-clip-alpha", "QK-clip's share on the queries "
                               "(eta ** alpha; the keys take eta ** (1 - alpha)).")
    qk_clip_threshold: float = opt(100.0, "--qk-clip-threshold", "The largest attention logit "
                                   "QK-clip lets stand.")
    seed: int = opt(1234, "--seed", "Random seed.")
    eval_interval: int = opt(100, "--eval-interval", "Evaluate every N iterations (0: never).")
    eval_iters: int = opt(4, "--eval-iters", "Validation batches per evaluation.")
    log_interval: int = opt(10, "--log-interval", "Console log every N iterations.")
    bf16: bool = opt(False, "--bf16", "bf16 parameters with fp32 main parameters.",
                     is_flag=True)
    fp16: bool = opt(False, "--fp16", "fp16 parameters with a dynamic loss scaler.",
                     is_flag=True)
    initial_loss_scale: float = opt(2.0 ** 16, "--initial-loss-scale", "fp16 initial scale.")
    min_loss_scale: float = opt(1.0, "--min-loss-scale", "fp16 smallest scale.")
    loss_scale_window: int = opt(1000, "--loss-scale-window",
                                 "fp16: steps without overflow before the scale grows.")
    hysteresis: int = opt(2, "--hysteresis", "fp16: overflows tolerated before backing off.")
    # Clean stops (core/training/preemption.py); SIGTERM/SIGINT are always handled.
    rerun_mode: str = opt("disabled", "--rerun-mode", "validate_results: a step whose loss is "
                          "NaN/Inf or spiky (or a gradient NaN/Inf) is re-run once on the same "
                          "data before the optimizer step; reproducible stops (NaN/Inf), "
                          "transient continues. report_stats is not implemented.",
                          choices=("disabled", "validate_results", "report_stats"))
    check_for_spiky_loss: bool = opt(False, "--check-for-spiky-loss", "With --rerun-mode "
                                     "validate_results, also validate loss spikes.",
                                     is_flag=True)
    spiky_loss_factor: float = opt(10.0, "--spiky-loss-factor", "A loss over this many times the "
                                   "largest of the first 100 steps is a spike.")
    check_for_nan_in_loss_and_grad: bool = opt(
        True, "--check-for-nan-in-loss-and-grad",
        "Never apply a step whose global gradient norm is NaN or Inf (fp32/bf16; under --fp16 "
        "the loss scaler skips it): the run stops at that iteration (Megatron's default).",
        is_flag=True, negative="--no-check-for-nan-in-loss-and-grad")
    check_weight_hash_across_dp_replicas_interval: int | None = opt(
        None, "--check-weight-hash-across-dp-replicas-interval",
        "Every N iterations (and before the first), compare a hash of every parameter across "
        "the data-parallel replicas; a replica that differs stops the run, naming the ranks "
        "and the parameter.")
    skip_nonfinite_steps: int = opt(
        0, "--skip-nonfinite-steps",
        "Skip up to this many steps with a NaN/Inf gradient norm over the run (counted in the "
        "metrics as nonfinite_skips) before stopping; 0: stop at the first.")
    exit_signal_handler: bool = opt(False, "--exit-signal-handler",
                                    "Also stop cleanly (finish the step, save) on SIGUSR1.",
                                    is_flag=True)
    exit_duration_in_mins: float | None = opt(None, "--exit-duration-in-mins",
                                              "Stop cleanly (and save) after this many minutes.")
    exit_interval: int | None = opt(None, "--exit-interval",
                                    "Stop cleanly (and save) at an iteration divisible by N.")
    # Activation recompute (core/training/recompute.py).
    recompute_granularity: str | None = opt(
        None, "--recompute-granularity", "Recompute activations in backward: full (whole "
        "layers) or selective (the parts --recompute-modules names).",
        choices=("full", "selective"))
    recompute_method: str = opt("uniform", "--recompute-method",
                                "full: uniform (groups of N layers) or block (first N layers "
                                "of each chunk).", choices=("uniform", "block"))
    recompute_num_layers: int = opt(1, "--recompute-num-layers",
                                    "full: layers per group (uniform) or per chunk (block).")
    recompute_modules: list = opt([], "--recompute-modules",
                                  "selective: the parts to recompute, by the names the layer "
                                  "types declare (default core_attn; repeatable or "
                                  "comma-separated).")


@dataclass
class DataConfig:
    data_path: list = opt([], "--data-path", "Files or folders of data (repeatable).")
    split: str = opt("969,30,1", "--split", "Train,valid,test weights over documents.")
    tokenizer_type: str | None = opt(None, "--tokenizer-type",
                                     "Tokenizer (plugtron.tokenizers): HuggingFaceTokenizer, "
                                     "NullTokenizer, ByteTokenizer (default: the dataset's).")
    tokenizer_model: str | None = opt(None, "--tokenizer-model",
                                      "Local tokenizer directory or file (never downloaded).")
    num_workers: int = opt(2, "--num-workers",
                           "Background threads preparing microbatches ahead of the step, in "
                           "order (0: in the main thread).")


@dataclass
class PluginConfig:
    """Each driver plugin by entry-point name; ``auto``: what the installed selectors
    (plugtron.selectors) choose, so the core names no plugin of its own."""

    model: str = opt("auto", "--model", "Model plugin (plugtron.models); auto: the installed "
                     "selectors' choice (plugtron-gpt answers gpt).")
    schedule: str = opt("auto", "--schedule",
                        "Pipeline schedule (plugtron.schedules), or auto from pp and vp.")
    optimizer: str = opt("auto", "--optimizer", "Optimizer (plugtron.optimizers); auto: adam, "
                         "or distributed-adam under --use-distributed-optimizer (which "
                         "another optimizer answers with its own sharded mode, if any).")
    data_parallel: str = opt("auto", "--data-parallel",
                             "Data-parallel wrapper (plugtron.data_parallel): ddp, fsdp2, or "
                             "auto from --use-torch-fsdp2 and --data-parallel-sharding-strategy.")
    layer_backend: str = opt("auto", "--layer-backend",
                             "Tensor-parallel layer backend (plugtron.layer_backends); auto: "
                             "the built-in local layers.")
    data: str = opt("auto", "--data", "Dataset provider (plugtron.datasets); auto: text files "
                    "or folders given with --data-path.")
    model_transforms: list = opt([], "--model-transforms",
                                 "Model transforms (plugtron.model_transforms) applied to every "
                                 "built model chunk, in this order (several values or "
                                 "comma-separated); a transform whose own flags turn it on "
                                 "follows those named here.")
    disabled: list = opt([], "-p", "Disable an extension plugin: -p no:NAME (repeatable).")


@dataclass
class CheckpointConfig:
    save: str | None = opt(None, "--save", "Directory to save checkpoints in.")
    save_interval: int | None = opt(None, "--save-interval", "Save every N iterations.")
    load: str | None = opt(None, "--load", "Checkpoint (or directory of them) to resume from.")
    exit_on_missing_checkpoint: bool = opt(
        False, "--exit-on-missing-checkpoint",
        "With --load set but no checkpoint there, exit (exit 2) instead of starting from "
        "scratch, also when --load is --save (Megatron's flag).", is_flag=True)
    async_save: bool = opt(False, "--async-save", "Write checkpoints in the background.",
                           is_flag=True)
    pretrained_checkpoint: str | None = opt(
        None, "--pretrained-checkpoint",
        "The checkpoint (or directory of them) a fine-tune starts from, with --finetune. A "
        "fine-tune whose model transforms add tensors saves only what it trains, naming this "
        "base; resuming it needs the same base here again.")
    finetune: bool = opt(False, "--finetune",
                         "Start from --pretrained-checkpoint's model weights only: iteration 0, "
                         "a fresh optimizer and LR schedule (Megatron's semantics). A --load "
                         "that holds a checkpoint resumes instead.", is_flag=True)


@dataclass
class LoggingConfig:
    metrics_file: str | None = opt(None, "--metrics-file",
                                   "Append one JSON object per iteration and evaluation.")
    log_num_zeros_in_grad: bool = opt(False, "--log-num-zeros-in-grad",
                                      "Count zero gradient elements each step.", is_flag=True)
    progress: bool = opt(True, "--progress", "Progress bar on rank 0.", is_flag=True,
                         negative="--no-progress")
    profile: bool = opt(False, "--profile", "Trace steps --profile-step-start..end with the "
                        "torch profiler (Chrome trace JSON per rank).", is_flag=True)
    profile_step_start: int = opt(10, "--profile-step-start", "First profiled iteration.")
    profile_step_end: int = opt(12, "--profile-step-end", "Last profiled iteration.")
    profile_ranks: list = opt([0], "--profile-ranks", "Global ranks to profile (repeatable).")
    profile_dir: str = opt("profiles", "--profile-dir", "Where the traces are written.")
    log_straggler: bool = opt(False, "--log-straggler", "Every --log-interval iterations, "
                              "gather each rank's forward-backward time and log the fastest and "
                              "slowest rank (metrics file and console).", is_flag=True)


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "plugins": PluginConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass(frozen=True)
class ConfigSection:
    """A typed block of options that a plugin declares (hook ``plugtron_config_sections``).

    ``cls`` is a dataclass whose fields are declared with :func:`opt`, exactly like the core's
    own sections; its values reach the plugin as ``config.<name>`` (an instance of ``cls``), go
    into config files under their flag names and into the checkpoint's config under ``name``.
    """

    name: str  # attribute on TrainConfig, e.g. "hybrid"; unique over all installed plugins
    cls: type
    #: Heading in ``plugtron train --help``; the collector fills in the distribution.
    title: str = ""
    #: A core section (``"model"``) whose fields this one adds to: they also read and write as
    #: ``config.<extends>.<field>``, are set by their bare field names and under ``[<extends>]``
    #: in config files, and are saved in the checkpoint's config inside ``<extends>``.
    extends: str | None = None
    #: Core sections these fields lived in before the plugin owned them (``("training",)`` for
    #: Adam's betas): a checkpoint's config written then still gives their values.
    formerly: tuple[str, ...] = ()


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    plugins: PluginConfig = field(default_factory=PluginConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    #: Sections declared by plugins: name -> dataclass instance (``config.<name>`` reads one).
    plugin_sections: dict = field(default_factory=dict)

    def __getattr__(self, name: str):
        # Only called when normal lookup fails: plugin sections read like core ones.
        sections = self.__dict__.get("plugin_sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")

    def add_section(self, name: str, cls: type, extends: str | None = None) -> None:
        """Attach a plugin's section with its defaults (kept if already attached)."""
        if name in SECTIONS:
            raise ConfigError(f"config section {name!r} belongs to the core")
        current = self.plugin_sections.get(name)
        if not isinstance(current, cls):
            current = self.plugin_sections[name] = cls()
        if extends is not None:
            base = getattr(self, extends, None)
            if not isinstance(base, ExtensibleSection):
                raise ConfigError(f"config section {name!r} extends {extends!r}, which is not "
                                  f"a core section that takes extensions")
            base._extensions[name] = current

    def extended_section(self, name: str) -> str | None:
        """The core section plugin section ``name`` extends, if any."""
        for core in SECTIONS:
            if name in getattr(getattr(self, core), "_extensions", {}):
                return core
        return None

    def sections(self) -> dict[str, Any]:
        """Every section, core first, as ``{name: instance}``."""
        out = {name: getattr(self, name) for name in SECTIONS}
        out.update(self.plugin_sections)
        return out

    def to_dict(self) -> dict:
        """Each section as a dict; extending sections' fields inside the section they extend."""
        out = {}
        for name, value in self.sections().items():
            if name in SECTIONS:
                out[name] = {f.name: _plain(getattr(value, f.name))
                             for f in dataclasses.fields(value) if not f.name.startswith("_")}
                if isinstance(value, ExtensibleSection):
                    out[name].update(value.extension_fields())
            elif self.extended_section(name) is None:
                out[name] = dataclasses.asdict(value)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict,
                  sections: dict[str, type | tuple] | None = None
                  ) -> "TrainConfig":
        """Core sections from ``data``; plugin sections too where ``sections`` gives their
        classes (``plugin_sections.config_from_dict`` collects them). Unknown keys are ignored:
        a checkpoint may carry the section of a plugin that is no longer installed."""
        config = cls()
        data = dict(data)
        for name, declared in (sections or {}).items():
            section_cls, extends, *rest = declared if isinstance(declared, tuple) else \
                (declared, None)
            config.add_section(name, section_cls, extends)
            for old in (rest[0] if rest else ()):  # fields a plugin took over from the core
                if name not in data and isinstance(data.get(old), dict):
                    names = {f.name for f in dataclasses.fields(section_cls)}
                    data[name] = {k: v for k, v in data[old].items() if k in names}
        for section, values in data.items():
            if section not in SECTIONS and section not in config.plugin_sections:
                continue
            if not isinstance(values, dict):
                continue
            target = getattr(config, section)
            names = {f.name for f in dataclasses.fields(target) if not f.name.startswith("_")}
            if isinstance(target, ExtensibleSection):
                names |= set(target.extension_fields())
            for key, value in values.items():
                if key in names:
                    setattr(target, key, value)
        return config


def _plain(value):
    """A field value as ``dataclasses.asdict`` gives it (containers copied)."""
    return json.loads(json.dumps(value)) if isinstance(value, (list, dict)) else value


# --------------------------------------------------------------------------- flag table


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: a multiple of ``divisible_by * tp`` so each tp rank gets equal rows."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def derive_padded_vocab_size(config: TrainConfig, tp: int) -> int:
    """The one place ``config.model.padded_vocab_size`` is derived (for a run or a build at
    tensor-parallel size ``tp``): Megatron's padding of ``vocab_size``."""
    m = config.model
    if m.vocab_size is None:
        raise ConfigError(f"data {selected_driver(config, 'dataset')!r} does not fix the "
                          f"vocabulary: give --vocab-size")
    m.padded_vocab_size = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    return m.padded_vocab_size


def num_microbatches(config: TrainConfig, dp_size: int) -> int:
    t = config.training
    return t.global_batch_size // (t.micro_batch_size * dp_size)


def validate_tensor_parallel(config: TrainConfig, tp: int | None = None) -> None:
    """What the core itself splits over tp: the padded vocabulary (vocab-parallel embedding and
    cross entropy) and, under sequence parallelism, the sequence. The model's own sizes (heads,
    groups, ffn, ...) are the model plugin's to check (``plugtron_validate``). Also run by the
    layer backend, so in-process runs fail here before any layer is built."""
    m, p = config.model, config.parallel
    tp = p.tensor_model_parallel_size if tp is None else tp
    cp = p.context_parallel_size
    if m.make_vocab_size_divisible_by < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by must be at least 1, got "
                          f"{m.make_vocab_size_divisible_by}")
    if m.vocab_size is not None and m.vocab_size < 1:
        raise ConfigError(f"--vocab-size must be at least 1, got {m.vocab_size}")
    for kind in ("bos", "eos", "pad"):
        token = getattr(m, f"{kind}_token_id", None)
        if token is not None and not (0 <= token < (m.vocab_size or token + 1)):
            raise ConfigError(f"--{kind}-token-id {token} is not a token id of the vocabulary "
                              f"(0 to --vocab-size - 1 = {(m.vocab_size or 1) - 1})")
    if m.padded_vocab_size is not None and m.padded_vocab_size % tp:
        raise ConfigError(f"the padded vocabulary {m.padded_vocab_size} is not divisible by "
                          f"--tp {tp} (it is padded to a multiple of "
                          f"--make-vocab-size-divisible-by x tp)")
    if p.sequence_parallel and tp > 1 and m.seq_length % (tp * cp):
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --tp {tp} x --cp "
                          f"{cp} = {tp * cp}, which --sequence-parallel needs (each tp rank "
                          f"holds an equal slice of the sequence)")
