"""The contracts between plugtron's core and its plugins, as pluggy hookspecs.

Three kinds of hooks live here:

* **Contract hooks** (``dataset_provider``, ``model_provider``, ``forward_step``, ``loss_func``,
  ``forward_backward``, ``schedule_actions``, ``build_optimizer``, ``wrap_model_chunk``). Their
  names and signatures
  follow Megatron-Core. For one run each must end up with exactly one implementation: the driver
  that the run selected by entry-point name. They are ``firstresult`` hooks, so calling one
  returns that implementation's value. Extension plugins may wrap them (``wrapper=True``).
* **Optional driver hooks** (``optimizer_shards_gradients``, ``optimizer_state_per_param``,
  ...): ``firstresult`` questions the core asks the selected driver of one role; a driver
  that does not implement one gets the default its docstring states.
* **Model-transform hooks** (``transform_model_chunk``): implemented by every model transform
  the run selects (``--model-transforms``, or a transform's own flag); the core calls each
  transform's implementation in turn, in the stated order, so each is ``firstresult`` over one
  implementation, and extensions may wrap it like a contract hook.
* **Lifecycle hooks** (prefixed ``plugtron_``). Any number of plugins may implement them; the
  core calls them at fixed points of a run. ``historic`` ones are replayed to plugins that are
  registered after the call.

pluggy lets an implementation accept any subset of a hookspec's parameters, so a model plugin
that only needs ``config`` and ``pre_process`` declares just those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # the types only: the contract imports nothing it describes
    import torch
    from plugtron.core.config import ConfigSection, TrainConfig
    from plugtron.core.contracts.converter import HFLinearMap
    from plugtron.core.contracts.data_parallel import DataParallelChunk, DataParallelMemory
    from plugtron.core.contracts.layer_backend import LayerBackend
    from plugtron.core.contracts.model_info import ModelInfo
    from plugtron.core.parallel.context import ParallelContext
    from plugtron.core.pipeline.p2p import P2PCommunicator
    from plugtron.core.pipeline.plan import Action
    from plugtron.core.training.optimizer import Optimizer
    from plugtron.core.training.state import TrainState
    from torch.utils.data import Dataset

    #: ``(loss_sum, num_tokens, report)``: what ``loss_func`` and the forward step's closure give.
    LossResult = tuple[torch.Tensor, torch.Tensor, dict]

PROJECT_NAME = "plugtron"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Hooks that at most one selected driver implements (absent: the core's default).
OPTIONAL_DRIVER_HOOKS: dict[str, str] = {
    "model_info": "model",
    "model_presets": "model",
    "optimizer_shards_gradients": "optimizer",
    "optimizer_state_per_param": "optimizer",
    # absent: the core's executor runs the schedule's ``schedule_actions`` (pipeline/executor.py)
    "forward_backward": "schedule",
    "pipeline_placement": "schedule",
    "optimizer_takes_dtensor_params": "optimizer",
    "optimizer_shards_layer_wise": "optimizer",
    "data_parallel_memory": "data_parallel",
    "dataset_vocab_size": "dataset",
    # absent: a checkpoint of a run with the transform cannot be exported merged
    "transform_merged_tensors": "model_transform",
    # absent: its checkpoints cannot be exported as a PEFT adapter
    "transform_peft_adapter": "model_transform",
    # asked of every installed transform by ``convert import-hf --peft-adapter``
    "transform_from_peft_adapter": "model_transform",
}

#: Hooks that every selected model transform implements (the core calls one transform at a time,
#: in the run's order), with the registry role that provides them.
TRANSFORM_HOOKS: dict[str, str] = {
    "transform_model_chunk": "model_transform",
}

#: Hooks that exactly one selected driver implements, with the registry role that provides it.
CONTRACT_HOOKS: dict[str, str] = {
    "dataset_provider": "dataset",
    "model_provider": "model",
    "forward_step": "model",
    "loss_func": "model",
    "schedule_actions": "schedule",
    "build_optimizer": "optimizer",
    "wrap_model_chunk": "data_parallel",
}


# --------------------------------------------------------------------------- contracts


@hookspec(firstresult=True)
def dataset_provider(config: TrainConfig, split_sizes: tuple[int, int, int],
                     parallel: ParallelContext
                     ) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Build the train, validation and test datasets.

    :param config: the run's ``TrainConfig``; ``config.data`` holds the data flags
        (``data_path``, ``split``, ``seq_length`` comes from ``config.model``).
    :param split_sizes: the number of samples the run will draw from each split
        ``(train, valid, test)``; a provider may return datasets that are larger or that wrap
        around, but never smaller than asked unless it can only give less.
    :param parallel: the run's ``ParallelContext`` (for providers that build on one rank and
        share).
    :returns: ``(train, valid, test)``, each a map-style dataset (``__len__`` and
        ``__getitem__``) or ``None``. A sample is a dict of 1-D tensors of length
        ``seq_length``: ``tokens`` (int64), ``labels`` (int64), ``loss_mask`` (float32),
        ``position_ids`` (int64), optionally ``attention_mask`` (int64, the document number of
        each token: attention stays within a document, ``--reset-attention-mask``).

    Called once per run on every rank, after process groups are ready and before the model is
    built. A provider may set ``config.model.vocab_size`` when its tokenizer fixes it; the core
    pads the vocabulary afterwards.
    """


@hookspec(firstresult=True)
def dataset_vocab_size(config: TrainConfig) -> int | None:
    """Say the vocabulary the dataset's tokens come from, before any data is read.

    :param config: the run's ``TrainConfig``.
    :returns: the vocabulary size (its tokenizer's: ``--tokenizer-type`` or the dataset's
        default; a synthetic dataset's own), or ``None`` when only reading the data tells.

    Optional; implemented by the dataset driver. Called before launch, without process groups,
    by ``plugtron estimate`` and train's memory check (the padded vocabulary sizes the
    embedding and the output layer); the run itself takes the vocabulary ``dataset_provider``
    fixes.
    """


@hookspec(firstresult=True)
def model_provider(
    config: TrainConfig,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None,
    layer_backend: LayerBackend,
    parallel: ParallelContext,
) -> torch.nn.Module:
    """Build one pipeline chunk of the model.

    :param config: the run's ``TrainConfig`` (model sizes are in ``config.model``).
    :param pre_process: this chunk is the first of the pipeline: it owns the embedding.
    :param post_process: this chunk is the last: it owns the final norm, output layer and loss.
    :param vp_stage: index of the virtual pipeline chunk on this rank, ``None`` without
        interleaving.
    :param layer_backend: the ``LayerBackend`` instance the run selected; the model builds its
        tensor-parallel layers from it, never by importing a backend.
    :param parallel: the run's ``ParallelContext``.
    :returns: a ``torch.nn.Module`` with ``set_input_tensor(tensor)``; a chunk that is not
        ``pre_process`` takes its input from the tensor set there.

    Called on every rank, once per virtual chunk the rank holds, before the optimizer is built.
    """


@hookspec(firstresult=True)
def transform_model_chunk(config: TrainConfig, module: torch.nn.Module, vp_stage: int | None,
                          layer_backend: LayerBackend, parallel: ParallelContext
                          ) -> torch.nn.Module:
    """Change one built model chunk: add modules and parameters, freeze parameters, swap a
    layer's linear for another.

    :param config: the run's ``TrainConfig`` (the transform's options are its own section).
    :param module: the chunk as ``model_provider`` built it, or as the transforms before this
        one left it; parameters in fp32, on the device the build runs on (the CPU, or the meta
        device for ``plugtron estimate``: build new tensors with ``torch.empty``/``zeros`` and
        the init helpers, which follow the current device, and never read values there).
    :param vp_stage: index of the virtual pipeline chunk on this rank, ``None`` without
        interleaving.
    :param layer_backend: the ``LayerBackend`` the chunk was built with (its ``dropout_rng``,
        its ``sequence_parallel``).
    :param parallel: the ``ParallelContext`` of the build: the run's, or a single-process one
        (``load_model``, the estimate's per-rank contexts, which have no process groups).
    :returns: the chunk to use from now on: ``module`` itself, changed in place, or a module
        that replaces it (it must keep ``set_input_tensor`` and the chunk's forward). A
        parameter the transform freezes has ``requires_grad`` False: the core and every
        built-in data-parallel wrapper and optimizer then give it no gradient buffer, no
        optimizer state and no data-parallel reduction, and leave it out of the grad norm.
        Parameter names must stay global (the same under every layout, as the model's are), and
        parameters the transform adds declare their tensor-parallel split
        (``plugtron.api.set_tensor_parallel``) like the model's own.

    Called wherever a model is built (core/training/builder.py ``build_model``: training and
    evaluation, ``plugtron estimate`` on the meta device, ``load_model`` and ``generate``), on
    every rank that builds, once per chunk and per transform the run selects, in the run's
    order: the names given to ``--model-transforms`` first, then those whose own flags turn
    them on (hook ``plugtron_select`` with role ``model_transform``), by name. Called after
    ``model_provider`` and before the chunk moves to the run's device and is wrapped for data
    parallelism (``wrap_model_chunk``). Raise ``plugtron.api.ConfigError`` for a model the
    transform cannot change (a target the model lacks).
    """


@hookspec(firstresult=True)
def transform_merged_tensors(config: TrainConfig, tensors: Mapping[str, torch.Tensor]
                             ) -> Mapping[str, torch.Tensor]:
    """Fold this transform back into the plain model's tensors, for export.

    :param config: the ``TrainConfig`` the checkpoint was saved with.
    :param tensors: the whole model's tensors by global name, full (not sharded over tp), read
        on demand: the plain model's, this transform's own, and those of the transforms
        applied before it (a fine-tune's checkpoint and its base together).
    :returns: a mapping without this transform's tensors whose values make the plain model
        compute what the transformed one did (LoRA: ``W + alpha / r * B @ A``); read lazily is
        best (the export writes one tensor at a time).

    Optional; implemented by model transforms. Called by ``plugtron convert export-hf`` in one
    process without process groups, once per transform the checkpoint's run applied, the last
    applied first, before the model's converter maps the tensors. A checkpoint of a transform
    without it is refused by the export, naming the transform.
    """


@hookspec(firstresult=True)
def transform_peft_adapter(config: TrainConfig, tensors: Mapping[str, torch.Tensor],
                           linears: HFLinearMap) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """Write this transform's tensors as a PEFT adapter of the plain model's Hugging Face export.

    :param config: the ``TrainConfig`` the checkpoint was saved with.
    :param tensors: the whole model's full tensors by global name, read on demand (as for
        ``transform_merged_tensors``).
    :param linears: the Hugging Face modules of the model's linears (the model's converter's
        ``hf_linear_map``).
    :returns: ``(adapter_config.json's object, {adapter_model.safetensors key: tensor})``, or
        None when this transform has no PEFT form.

    Optional. Called by ``plugtron convert export-hf --adapter-only`` in one process without
    process groups, when the checkpoint's run applied this transform alone. Raise ``ConfigError``
    for a setting PEFT cannot express.
    """


@hookspec(firstresult=True)
def transform_from_peft_adapter(adapter_config: dict, tensors: Mapping[str, torch.Tensor],
                                linears: HFLinearMap, base: Mapping[str, torch.Tensor]
                                ) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """Read a PEFT adapter as this transform's tensors over an imported base model.

    :param adapter_config: the adapter's ``adapter_config.json``.
    :param tensors: the tensors of its ``adapter_model.safetensors`` by key.
    :param linears: the Hugging Face modules of the base model's linears.
    :param base: the imported base model's tensors by plugtron name (shapes to check against).
    :returns: ``({flag: value} that apply this transform, {plugtron name: tensor})``, or None
        when the adapter is not of this transform's kind (its ``peft_type``).

    Optional. Called by ``plugtron convert import-hf --peft-adapter`` in one process without
    process groups, on every installed model transform; the first answer wins. Raise ``ConfigError`` naming a setting of the adapter
    this transform cannot express (exit 2).
    """


@hookspec(firstresult=True)
def forward_step(data_iterator: Iterator[dict] | None, model: torch.nn.Module
                 ) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossResult]]:
    """Run the forward pass of one microbatch on one pipeline chunk.

    :param data_iterator: yields microbatches (dicts of batched tensors, see
        ``dataset_provider``); stages that need no data may still draw from it so that every
        stage stays on the same microbatch.
    :param model: the chunk (as wrapped for data parallelism).
    :returns: ``(output_tensor, loss_closure)``. ``output_tensor`` is the activation for the next
        stage, or on the last stage the per-token loss or logits. ``loss_closure`` is
        ``plugtron.api.loss_closure(loss_mask)``: the core binds it to the run's ``loss_func``
        hook (wrappers included) and the schedule calls ``loss_closure(output_tensor)`` on the
        last stage only (Megatron's ``partial(loss_func, loss_mask)``; a plain closure still
        works in contract 3, with a deprecation, but bypasses the hook).

    Called by the schedule, once per microbatch and chunk, on every pipeline stage.
    """


@hookspec(firstresult=True)
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> LossResult:
    """Reduce a microbatch's per-token losses.

    :param loss_mask: float tensor ``[batch, seq]``; 0 marks tokens that do not count.
    :param output_tensor: per-token losses ``[batch, seq]`` from the last stage.
    :returns: ``(loss_sum, num_tokens, report)``: the masked *sum* of per-token losses (a
        scalar that backward starts from), the number of counted tokens (a tensor), and a report
        dict such as ``{"lm loss": tensor([sum, count])}`` that the core sums over microbatches
        and data-parallel ranks.

    Must check the local loss for NaN/Inf before any reduction across ranks and name the
    iteration and rank in the error. Called by the core, through the loss closure that
    ``forward_step`` returned, once per microbatch on the last pipeline stage only.
    """


@hookspec(firstresult=True)
def forward_backward(
    forward_step_func: Callable[..., tuple[torch.Tensor, Callable]],
    data_iterator: Iterator[dict] | list[Iterator[dict]],
    model: list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    parallel: ParallelContext,
    config: TrainConfig,
    p2p: P2PCommunicator | None,
    loss_scale: float,
) -> list[dict]:
    """Run forward and backward over all microbatches of one global batch on this rank.

    Optional: a schedule that implements only ``schedule_actions`` gets the core's executor
    (``plugtron.api.execute_actions`` over those lists), which is what every built-in schedule
    uses. Implement it to run something the action lists cannot express.

    :param forward_step_func: call as ``forward_step_func(data_iterator, model_chunk)``; it is
        the run's ``forward_step`` hook with any wrappers.
    :param data_iterator: an iterator of microbatches, or a list with one per model chunk under
        interleaving.
    :param model: list of this rank's model chunks (one unless interleaved).
    :param num_microbatches: microbatches per global batch on this data-parallel rank.
    :param seq_length: tokens per sample; with ``micro_batch_size`` fixes P2P shapes.
    :param micro_batch_size: samples per microbatch.
    :param forward_only: evaluation: no backward, no grad sync.
    :param parallel: the run's ``ParallelContext``.
    :param config: the run's ``TrainConfig``.
    :param p2p: the core's pipeline communicator (``None`` when pp is 1).
    :param loss_scale: factor for the loss before backward (1.0 except under fp16 scaling).
    :returns: the list of ``report`` dicts, one per microbatch, on the last pipeline stage; an
        empty list on other stages. The report of each microbatch carries ``num_tokens`` too.

    A schedule must: call ``model_chunk.set_input_tensor`` before each forward on stages after
    the first; call the loss closure on the last stage; run backward from ``loss_sum *
    loss_scale``; wrap all but the last microbatch of each chunk in the chunk's ``no_sync()``;
    and execute its actions in the order that ``schedule_actions`` returns.
    Called once per iteration on every rank.
    """


@hookspec(firstresult=True)
def schedule_actions(
    pp_rank: int, pp_size: int, num_chunks: int, num_microbatches: int, config: TrainConfig
) -> list[Action]:
    """Return the ordered actions one pipeline rank executes in one iteration.

    :param pp_rank: the pipeline rank.
    :param pp_size: number of pipeline stages.
    :param num_chunks: model chunks per rank (the virtual pipeline size, 1 without it).
    :param num_microbatches: microbatches per global batch on this data-parallel rank.
    :param config: the run's ``TrainConfig`` (schedules read their own options from it).
    :returns: a list of ``plugtron.core.pipeline.plan.Action`` (kind, microbatch, chunk).
        Kinds: ``"F"`` forward; ``"B"`` the whole backward; or the backward split in two,
        ``"I"`` (the gradient of the stage input, sent to the previous stage) and, any time
        after it on the same rank, ``"W"`` (the weight gradients of that microbatch on that
        chunk: layers that opt in through ``plugtron.api.defer_weight_grad`` compute them here,
        the others already did at ``I``). Each (microbatch, chunk) has one ``F`` and either
        one ``B`` or one ``I`` and one ``W``; a list that leaves a ``W`` out, or puts it before
        its ``I``, is rejected before the run. ``plugtron schedule show`` prints exactly this
        list, and ``forward_backward`` executes exactly it, so both share one source of truth.

    Raises ``plugtron.core.errors.ConfigError`` for combinations the schedule does not support.
    Called without process groups (by the CLI) and inside ``forward_backward``.
    """


@hookspec(firstresult=True)
def pipeline_placement(pp_size: int, config: TrainConfig) -> str:
    """Say where the schedule's virtual stages live.

    :param pp_size: number of pipeline ranks.
    :param config: the run's ``TrainConfig``.
    :returns: ``"looped"`` (chunk ``c`` of rank ``p`` is stage ``c * pp + p``: Megatron's
        interleaving) or ``"v"`` (two chunks per rank; rank ``p`` holds stages ``p`` and
        ``2 * pp - 1 - p``, so the first and the last stage share rank 0: ZB-V, DualPipeV).
        No implementation: ``"looped"``. Under ``"v"`` the run has two chunks per rank (``--vp``
        left out means 2, any other ``--vp`` is refused), and everything that follows the
        stages follows the placement: the layers each chunk builds (``chunk_layers`` with
        ``placement=parallel.pipeline_placement``), which chunk gets ``pre_process`` and
        ``post_process``, the point-to-point plan (a hand-over between two chunks of one rank
        is local), the tied-embedding group and ``plugtron topology``. Checkpoints are
        layout-free: a run saved under one placement resumes under the other.

    Optional; implemented by the schedule driver only. Called before the process groups are
    built, on every rank and by the CLI (``schedule show``, validation) without process
    groups, so it must depend on its arguments alone.
    """


@hookspec(firstresult=True)
def build_optimizer(config: TrainConfig, model_chunks: list[torch.nn.Module],
                    parallel: ParallelContext) -> Optimizer:
    """Build the optimizer over all model chunks of this rank.

    :param config: the run's ``TrainConfig`` (``config.training`` has lr, betas, weight decay,
        clipping).
    :param model_chunks: the rank's model chunks, wrapped for data parallelism.
    :param parallel: the run's ``ParallelContext``.
    :returns: a ``plugtron.core.training.optimizer.Optimizer``: ``step()`` returns
        ``StepResult(stepped, grad_norm, num_zeros)``, ``zero_grad()``, ``param_groups`` for the
        LR scheduler, and ``sharded_state_dict()`` / ``load_sharded_state_dict()`` for
        checkpoints.

    Weight decay is not applied to norms and biases. Called once per run on every rank.
    """


@hookspec(firstresult=True)
def optimizer_shards_gradients(config: TrainConfig) -> bool:
    """Say whether the optimizer shards gradients and parameters over data parallelism.

    :param config: the run's ``TrainConfig``.
    :returns: ``True`` when the optimizer keeps state only for this data-parallel rank's shard
        of the gradients (ZeRO-1, as ``distributed-adam``): the core's
        ``DistributedDataParallel`` then pads its buckets into equal shards, reduce-scatters
        the gradients and all-gathers the parameters after the step, and the optimizer reaches
        its shards through ``DistributedDataParallel.optimizer_shards()``. ``False``, or no
        implementation at all: gradients are all-reduced whole.

    Optional; implemented by the optimizer driver only. Called on every rank before the model
    chunks are wrapped for data parallelism (so before ``build_optimizer``), and by the CLI
    before launch to validate ``--overlap-param-gather``, without process groups.
    """


@hookspec(firstresult=True)
def optimizer_state_per_param(config: TrainConfig, name: str, param: torch.nn.Parameter) -> int:
    """Say how many fp32 values the optimizer keeps per element of one parameter, for
    ``plugtron estimate`` and the memory check before launch.

    :param config: the run's ``TrainConfig``.
    :param name: the parameter's name as ``plugtron.api.named_params`` gives it.
    :param param: the trainable parameter, on the meta device, at this rank's local shape, with
        the attributes the model set on it (``ndim``, ``is_embedding_or_output_parameter``,
        ``allreduce``...): what an optimizer that treats parameters apart needs to tell them
        apart (Muon: its matrices 1, AdamW's others 2).
    :returns: the state values per element of ``param``, the fp32 main copy under bf16/fp16
        not included (the core counts it): Adam's two moments 2, SGD 1 with momentum and 0
        without, Lion 1. Scalars kept per tensor (torch's step counters) are not counted. An
        optimizer that answers ``optimizer_shards_gradients`` with ``True`` has them counted
        sharded over dp x cp; one that answers ``optimizer_shards_layer_wise`` with ``True``
        has each parameter counted on the rank that steps it.

    Optional; implemented by the optimizer driver only. An implementation may take ``config``
    alone (the form before contract 3's non-element-wise optimizers): its one answer then
    counts for every parameter. Without an implementation the estimate counts 2 (Adam's) and
    says so in its notes. Called before launch, without process groups, once per trainable
    parameter of every rank position.
    """


@hookspec(firstresult=True)
def optimizer_takes_dtensor_params(config: TrainConfig) -> bool:
    """Say whether the optimizer can step parameters that are DTensors sharded over data
    parallelism (a sharding data-parallel wrapper such as ``fsdp2`` hands it those).

    :param config: the run's ``TrainConfig``.
    :returns: ``True`` when ``build_optimizer`` accepts chunks whose parameters (and
        gradients) are ``torch.distributed.tensor.DTensor`` s: torch's own optimizers do, and
        ``plugtron.api.TorchOptimizer`` handles the norm, clipping and checkpoint state over
        the shards. ``False``, or no implementation: a sharding wrapper refuses the run before
        launch.

    Optional; implemented by the optimizer driver only. Called before launch, without process
    groups.
    """


@hookspec(firstresult=True)
def optimizer_shards_layer_wise(config: TrainConfig) -> bool:
    """Say whether the optimizer shards its state over data parallelism by whole parameters.

    :param config: the run's ``TrainConfig``.
    :returns: ``True`` when, for this config, each data-parallel rank keeps state only for the
        whole parameters it owns and shares them after the step
        (``plugtron.api.LayerWiseOptimizer``): the answer of an optimizer that needs whole
        tensors (Muon) when the run asks for a sharded optimizer
        (``--use-distributed-optimizer``: ``plugtron.api.optimizer_sharding_requested``).
        Gradients stay all-reduced whole. ``False``, or no implementation: a run that asks
        for a sharded optimizer is refused before launch, unless the optimizer answers
        ``optimizer_shards_gradients`` (ZeRO-1).

    Optional; implemented by the optimizer driver only. Called before launch, without process
    groups, by the selector that owns the flag (the built-in ``megatron``) and by
    ``plugtron estimate`` (which then counts the optimizer's state split over dp x cp).
    """


@hookspec(firstresult=True)
def wrap_model_chunk(config: TrainConfig, module: torch.nn.Module, parallel: ParallelContext,
                     shard_gradients: bool) -> DataParallelChunk:
    """Wrap one model chunk for data parallelism.

    :param config: the run's ``TrainConfig`` (``config.parallel`` has the data-parallel flags).
    :param module: the chunk ``model_provider`` built, on the run's device, parameters in fp32;
        the wrapper decides the dtype it keeps them in (``ddp``: the training dtype; ``fsdp2``:
        fp32 shards with compute in the training dtype). ``plugtron.api.model_dtype(config)``
        is the training dtype.
    :param parallel: the run's ``ParallelContext``: ``dp_cp_group`` (dense parameters) and
        ``edp_group`` (expert parameters, ``allreduce = False``) are the groups to reduce over.
    :param shard_gradients: the optimizer's answer to ``optimizer_shards_gradients``.
    :returns: an object following ``plugtron.api.DataParallelChunk`` (docs/plugins/
        data-parallel.md): forward, ``set_input_tensor``, ``no_sync``, the grad sync and
        scaling, and the attributes that tell the core how gradients are laid out.

    Called once per chunk on every rank, after the model is built and before
    ``build_optimizer``.
    """


@hookspec(firstresult=True)
def data_parallel_memory(config: TrainConfig, chunks: list[torch.nn.Module], dp_cp: int,
                         edp: int, state_per_param: int,
                         state_values: Callable[[torch.nn.Parameter], int],
                         shard_gradients: bool) -> DataParallelMemory:
    """Count one rank's parameters, gradients and optimizer state under this wrapper, for
    ``plugtron estimate`` and the memory check before launch.

    :param config: the run's ``TrainConfig``.
    :param chunks: the model chunks of one rank position, built on the meta device (shapes
        only, unwrapped); expert parameters carry ``allreduce = False``.
    :param dp_cp: ranks that share the dense parameters (dp x cp).
    :param edp: ranks that share the expert parameters (the expert data-parallel group).
    :param state_per_param: the largest answer of hook ``optimizer_state_per_param`` over
        these chunks' parameters (fp32 optimizer values per element, the main copy not
        included): a bound, for a wrapper that counts one number for every parameter.
    :param state_values: ``state_values(param)``, the optimizer's answer for one parameter of
        ``chunks`` (0 for a frozen one): what a wrapper counts exactly with, parameter by
        parameter.
    :param shard_gradients: the optimizer's answer to ``optimizer_shards_gradients``.
    :returns: a ``plugtron.api.DataParallelMemory``.

    Optional; implemented by the data-parallel driver only. Without it the estimate counts
    whole parameters and gradients on every rank (``ddp``'s count) and says so. Called before
    launch, without process groups.
    """


# --------------------------------------------------------------------------- lifecycle


@hookspec
def plugtron_config_sections() -> list[ConfigSection]:
    """Declare this plugin's options as typed config sections.

    :returns: a list of ``plugtron.api.ConfigSection(name, cls)``; ``cls`` is a dataclass whose
        fields are declared with ``plugtron.api.opt(default, "--flag", "help", ...)``. Each field
        becomes a ``plugtron train`` flag listed under a heading naming the distribution, a
        config-file key, and ``config.<name>.<field>`` in the run (typed); the checkpoint's
        config keeps the section under ``name``.

    Called when the CLI builds a command and when a rank reads its config, on the selected
    drivers (model, schedule, optimizer, data-parallel wrapper, dataset), the selected layer
    backend, every installed layer type, MoE dispatcher and selector, and every enabled
    extension. Layer types, dispatchers, selectors and layer backends are classes: they declare
    it as a ``staticmethod``/``classmethod``. A
    plugin that raises here, or whose names clash with another's, is skipped with a warning.
    """


@hookspec
def plugtron_select(role: str, config: TrainConfig) -> str | None:
    """Answer which driver of ``role`` a run of ``config`` uses (a selector's hook).

    :param role: ``"schedule"``, ``"optimizer"``, ``"data_parallel"``, ``"model"``,
        ``"dataset"``, or ``"model_transform"`` (asked of every installed model transform).
    :param config: the run's ``TrainConfig``; the selector's own section holds the flags it
        answers (``--use-torch-fsdp2``), ``config.plugins`` the names the user gave (``auto``
        where none).
    :returns: an entry-point name of ``role``, or ``None`` when this selector has nothing to
        say. Raise ``plugtron.api.ConfigError`` for flags that contradict the name given.

    Implemented by selectors (entry-point group ``plugtron.selectors``; built in: ``megatron``,
    Megatron's ``auto`` schedule and its data-parallel flags), whose sections and validation
    are always collected. A model transform answers role ``model_transform`` with its own name
    when its own flags turn it on (a rank given for its adapters); for that role every answer
    counts, after the names ``--model-transforms`` gives.

    Called by the core whenever it resolves a run's drivers or transforms, before launch and
    on every rank, without process groups; two selectors that answer differently for a driver
    role are refused, naming both. The core itself maps no flag to a plugin name.
    """


@hookspec
def plugtron_validate(config: TrainConfig, world_size: int) -> None:
    """Check this plugin's part of the configuration before any rank is launched.

    :param config: the whole ``TrainConfig`` (core and plugin sections), not yet finalised:
        ``config.model.padded_vocab_size`` is still ``None``.
    :param world_size: the number of ranks the run will have.
    :raises plugtron.api.ConfigError: naming the flag, the value and the rule; the CLI prints
        it once and exits with code 2.

    Called by the CLI once before launching ranks, and by ``setup`` in every rank (so runs
    started from Python are checked too), on the same plugins as ``plugtron_config_sections``.
    The model plugin owns its size rules here (heads, groups, ffn, what tp must divide).
    """


@hookspec(firstresult=True)
def model_info(config: TrainConfig) -> ModelInfo:
    """Describe the model this config builds, for the core's logging and checkpoints.

    :param config: the run's ``TrainConfig``.
    :returns: a ``plugtron.api.ModelInfo``: ``main_loss`` (the report key that is the
        model's loss, shown in the progress bar and summary; default ``"lm loss"``) and
        ``architecture`` (``{flag: effective value}`` of every setting that changes tensor
        shapes or what the weights compute; a checkpoint resumes only into a run that agrees
        on all of them).

    Optional, implemented by the model driver. Called on every rank in ``setup`` and when a
    checkpoint is loaded (for the saved config too).
    """


@hookspec(firstresult=True)
def model_presets() -> dict[str, dict[str, Any]]:
    """Named sizes for ``--preset``.

    :returns: ``{preset name: {flag name: value}}``, applied after the built-in defaults and
        before the config file and the flags.

    Optional, implemented by the model driver. Called by the CLI when it builds ``train``.
    """


@hookspec(historic=True)
def plugtron_configure(config: TrainConfig) -> None:
    """Inspect or adjust the run's configuration before anything is built.

    :param config: the validated ``TrainConfig``; changes made here are seen by the whole run.

    Called once per rank after the plugin manager is built.
    """


@hookspec(historic=True)
def plugtron_process_groups_ready(parallel: ParallelContext) -> None:
    """Hear that the process groups exist.

    :param parallel: the run's ``ParallelContext``.

    Called once per rank after ``ParallelContext`` is built.
    """


@hookspec
def plugtron_model_built(config: TrainConfig, model_chunks: list[torch.nn.Module],
                         parallel: ParallelContext) -> None:
    """Hear that this rank's model chunks are built and wrapped.

    :param config: the run's ``TrainConfig``.
    :param model_chunks: the rank's chunks, in virtual-stage order.
    :param parallel: the run's ``ParallelContext``.

    Called once per rank, before the optimizer is built.
    """


@hookspec
def plugtron_train_start(config: TrainConfig, state: TrainState) -> None:
    """Hear that the training loop starts.

    :param config: the run's ``TrainConfig``.
    :param state: the ``TrainState`` (iteration, consumed samples) the loop starts from.

    Called once per rank.
    """


@hookspec
def plugtron_step_end(iteration: int, metrics: dict) -> None:
    """Hear the metrics of a finished training step.

    :param iteration: the 1-based iteration that just finished.
    :param metrics: the line written to ``--metrics-file`` (``lm_loss``, ``grad_norm``, ``lr``,
        ``tokens_per_sec``, ``step_time_s``, ``consumed_samples`` ...).

    Called on every rank after every iteration; only global rank 0 writes metrics.
    """


@hookspec
def plugtron_evaluation_end(iteration: int, metrics: dict) -> None:
    """Hear the result of an evaluation on the validation data.

    :param iteration: the iteration after which it ran.
    :param metrics: the line written to ``--metrics-file`` (``valid_<loss key>`` for every
        loss the model reports).

    Called on every rank after every evaluation during and at the end of training.
    """


@hookspec
def plugtron_checkpoint_saved(iteration: int, path: str) -> None:
    """Hear that a checkpoint is complete on disk.

    :param iteration: the iteration the checkpoint holds.
    :param path: its directory.

    Called on every rank after the checkpoint was renamed into place.
    """


@hookspec
def plugtron_train_end(config: TrainConfig, state: TrainState, summary: dict) -> None:
    """Hear that the run finished.

    :param config: the run's ``TrainConfig``.
    :param state: the final ``TrainState``.
    :param summary: the final summary line (iterations, final loss, tokens/s, time).

    Called once per rank, after the last checkpoint.
    """
