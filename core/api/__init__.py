"""``plugtron.api``: every name a plugin may use, in one module.

The built-in plugins import the core through this module only (tests/contracts/test_public_api.py
enforces it), so whatever they can do, a third-party package can do too. docs/api.md lists each
name with its signature and stability. Names marked *stable* keep their signature within a major
version; *provisional* ones may still change in a minor version, with a note in
docs/migration.md.
"""

from plugtron.core.blocks.cpu_features import cpu_matrix_support
from plugtron.core.blocks.deferred_ops import affine, batched_linear, grouped_linear
from plugtron.core.blocks.deferred_ops import layer_norm as deferred_layer_norm
from plugtron.core.blocks.forward_context import (
    ForwardContext,
    current_forward_context,
    forward_context,
    use_forward_context,
)
from plugtron.core.blocks.gated_silu import silu_and_mul
from plugtron.core.blocks.init import InitMethod, normal_init, scaled_normal_init
from plugtron.core.blocks.layer_stack import ComposedLayer
from plugtron.core.blocks.linear import linear
from plugtron.core.blocks.qk_clip import mark_qk_clip_rows, record_max_logits
from plugtron.core.blocks.rotary import (
    apply_rotary,
    rotary_freqs,
    rotary_freqs_at,
    yarn_attention_factor,
    yarn_mscale,
)
from plugtron.core.blocks.samples import (
    SAMPLE_SECTION,
    SampleOptions,
    document_numbers,
    document_runs,
    documents_masked,
    sample_from_window,
    validate_sample_options,
)
from plugtron.core.checkpoint.saved_config import saved_config
from plugtron.core.config import ConfigSection, TrainConfig, opt
from plugtron.core.contracts.activations import (
    ActivationShape,
    ChunkActivations,
    decoder_activations,
)
from plugtron.core.contracts.data_parallel import DataParallelChunk, DataParallelMemory
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.contracts.layer_backend import LayerBackend
from plugtron.core.contracts.layers import load_layer_types, substitute_symbols
from plugtron.core.contracts.loss import LossClosure, loss_closure
from plugtron.core.contracts.model_info import ModelInfo, model_info_for
from plugtron.core.contracts.selectors import fallback
from plugtron.core.contracts.tokenizer import Tokenizer
from plugtron.core.contracts.versions import (
    CONTRACT_VERSION,
    PlugtronDeprecationWarning,
    require_contract,
)
from plugtron.core.contracts.weight_grads import (
    WeightGradStore,
    defer_weight_grad,
    split_backward_expected,
)
from plugtron.core.errors import CheckpointError, ConfigError, PluginError, PlugtronError
from plugtron.core.parallel.comm import (
    all_gather_tensor,
    all_reduce,
    broadcast,
    group_rank,
    group_size,
    reduce_scatter_tensor,
)
from plugtron.core.parallel.context import (
    LOOPED,
    V_SHAPE,
    ParallelContext,
    stage_owner,
    virtual_stage,
)
from plugtron.core.parallel.context_parallel import (
    check_context_parallel_layers,
    chunk_order,
    local_positions,
    rank_positions,
    split_context_parallel_batch,
    sum_over_context_parallel,
)
from plugtron.core.parallel.cp_attention import (
    all_gather_attention,
    all_to_all_attention,
    context_parallel_attention,
    ring_attention,
)
from plugtron.core.parallel.ddp import DistributedDataParallel
from plugtron.core.parallel.expert_comm import all_to_all, all_to_all_counts
from plugtron.core.parallel.random import (
    EXPERT_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_rng_tracker,
)
from plugtron.core.parallel.sharding import (
    block_sizes,
    full_tensor,
    fused_part_rows,
    gather_tp_shards,
    is_dtensor,
    is_tensor_parallel,
    local_tensor,
    mark_fused_parts,
    mark_sequence_parallel,
    set_tensor_parallel,
    shard_like,
    shard_of,
    tp_split_of,
)
from plugtron.core.parallel.shared_params import share_parameter
from plugtron.core.parallel.tensor_parallel import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    sequence_parallel_linear,
)
from plugtron.core.parallel.vocab_parallel import (
    VocabParallelEmbedding,
    parallel_linear_cross_entropy,
    parallel_logits,
    vocab_parallel_cross_entropy,
)
from plugtron.core.pipeline.executor import ActionListSchedule, execute_actions
from plugtron.core.pipeline.layout import chunk_layers, stage_layer_counts
from plugtron.core.pipeline.plan import Action, ActionKind
from plugtron.core.pipeline.steps import backward_step as schedule_backward_step
from plugtron.core.pipeline.steps import forward_step as schedule_forward_step
from plugtron.core.pipeline.steps import sync_context
from plugtron.core.plugins.manager import shards_layer_wise as optimizer_shards_layer_wise
from plugtron.core.plugins.manager import takes_dtensor_params as optimizer_takes_dtensor_params
from plugtron.core.plugins.manager import wants_sharded_gradients
from plugtron.core.plugins.registry import PluginRole
from plugtron.core.plugins.registry import load as load_plugin
from plugtron.core.plugins.selection import (
    optimizer_sharding_requested,
    selected_driver,
    selected_drivers,
)
from plugtron.core.plugins.tokenizers import build_tokenizer, tokenizer_for
from plugtron.core.tools.estimate import estimate_memory
from plugtron.core.tools.generation import InferenceState, generate
from plugtron.core.tools.inference import load_model
from plugtron.core.training.aux_losses import add_loss
from plugtron.core.training.builder import model_dtype, reference_model
from plugtron.core.training.data import collate
from plugtron.core.training.optimizer import (
    OPTIMIZER_STATE_KEY,
    MixedPrecisionOptimizer,
    Optimizer,
    StepResult,
    TorchOptimizer,
    adamw_factory,
    named_params,
    no_weight_decay,
    param_groups_for,
)
from plugtron.core.training.optimizer_shards import BucketShard, LayerWiseOptimizer, ParamShard
from plugtron.core.training.recompute import is_recomputing, recompute, recompute_module, run_layers
from plugtron.core.training.step_info import check_finite

__all__ = [
    # plugins, their roles and options, errors
    "hookimpl", "ConfigSection", "opt", "TrainConfig", "selected_driver", "selected_drivers",
    "PluginRole",
    "load_plugin", "saved_config", "CONTRACT_VERSION", "require_contract",
    "PlugtronDeprecationWarning", "fallback",
    "PlugtronError", "ConfigError", "PluginError", "CheckpointError",
    # building a model: its description, layer types, composition, init, losses, parameters
    "ModelInfo", "model_info_for", "LayerBackend", "load_layer_types", "substitute_symbols",
    "ComposedLayer", "chunk_layers", "stage_layer_counts",
    "virtual_stage", "stage_owner", "LOOPED", "V_SHAPE",
    "InitMethod", "normal_init", "scaled_normal_init", "check_finite", "add_loss",
    "loss_closure", "LossClosure",
    "share_parameter", "ParallelContext",
    "ForwardContext", "forward_context", "current_forward_context", "use_forward_context",
    "recompute", "recompute_module", "run_layers", "is_recomputing",
    "ActivationShape", "ChunkActivations", "decoder_activations",
    # using a trained model, and sizing one
    "load_model", "generate", "InferenceState", "estimate_memory",
    # tensor parallelism
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "sequence_parallel_linear", "linear",
    "affine", "batched_linear", "grouped_linear", "deferred_layer_norm", "silu_and_mul",
    "cpu_matrix_support",
    "set_tensor_parallel", "is_tensor_parallel", "shard_of", "block_sizes",
    "mark_sequence_parallel", "mark_fused_parts", "fused_part_rows", "gather_tp_shards",
    "tp_split_of",
    "record_max_logits", "mark_qk_clip_rows",
    "apply_rotary", "rotary_freqs", "rotary_freqs_at", "yarn_attention_factor", "yarn_mscale",
    "VocabParallelEmbedding", "parallel_logits", "vocab_parallel_cross_entropy",
    "parallel_linear_cross_entropy",
    "RNGStatesTracker", "model_parallel_rng_tracker", "EXPERT_PARALLEL_RNG",
    # context parallelism
    "context_parallel_attention", "ring_attention", "all_gather_attention",
    "all_to_all_attention", "split_context_parallel_batch", "local_positions", "chunk_order",
    "rank_positions",
    "check_context_parallel_layers", "sum_over_context_parallel",
    # collectives
    "all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "broadcast", "group_size",
    "group_rank", "all_to_all", "all_to_all_counts",
    # schedules
    "Action", "ActionKind", "ActionListSchedule", "execute_actions", "schedule_forward_step",
    "WeightGradStore", "defer_weight_grad", "split_backward_expected",
    "schedule_backward_step", "sync_context",
    # optimizers and data parallelism
    "Optimizer", "StepResult", "MixedPrecisionOptimizer", "TorchOptimizer", "adamw_factory",
    "named_params", "no_weight_decay", "param_groups_for", "OPTIMIZER_STATE_KEY",
    "DistributedDataParallel", "BucketShard", "ParamShard", "LayerWiseOptimizer",
    "optimizer_shards_layer_wise", "optimizer_sharding_requested",
    "DataParallelChunk", "DataParallelMemory", "model_dtype", "reference_model", "wants_sharded_gradients",
    "optimizer_takes_dtensor_params", "is_dtensor", "local_tensor", "full_tensor", "shard_like",
    # datasets and tokenizers
    "collate", "build_tokenizer", "tokenizer_for", "Tokenizer",
    "SAMPLE_SECTION", "SampleOptions", "sample_from_window", "validate_sample_options",
    "document_numbers", "document_runs", "documents_masked",
]
