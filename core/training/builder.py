"""The one model builder: a rank's model chunks, from the model plugin's ``model_provider``,
then the run's model transforms (``transform_model_chunk``), in order.

Training, evaluation, ``load_model`` (inference), the strict Hugging Face import's shape check
(the plain model, without transforms: the files hold that) and the memory estimate all build
here, so a model plugin and the transforms are called one way everywhere: one chunk per
virtual pipeline stage, the embedding on the chunk that holds the first stage, the output layer
and loss on the chunk that holds the last (wherever the schedule's placement puts them). Callers choose where the parameters live (a
``torch.device("meta")`` context builds shapes only) and what wraps the chunks.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import pluggy
import torch
from plugtron.core.config import padded_vocab_size
from plugtron.core.errors import PluginError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.sharding import added_by_transform, mark_added_by_transform
from plugtron.core.pipeline.layout import building_for
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import (
    new_plugin_manager,
    register_driver,
    register_transforms,
    transform_caller,
)
from plugtron.core.plugins.selection import selected_driver, selected_transforms

if TYPE_CHECKING:
    import torch
    from plugtron.core.config import TrainConfig
    from plugtron.core.contracts.layer_backend import LayerBackend


def model_plugins_of(config: TrainConfig) -> pluggy.PluginManager:
    """A plugin manager of ``config``'s model plugin and model transforms alone (no
    extensions): for builds outside a run, which has its own."""
    pm = new_plugin_manager()
    register_driver(pm, "model", selected_driver(config, "model"))
    register_transforms(pm, config)
    return pm


def build_model(config: TrainConfig, parallel: ParallelContext, *,
                plugins: pluggy.PluginManager | None = None,
                layer_backend: LayerBackend | str | None = None,
                transforms: bool = True) -> list[torch.nn.Module]:
    """This rank's model chunks, one per virtual pipeline stage (one without ``--vp``), each
    changed by the run's model transforms in their order (hook ``transform_model_chunk``).

    ``plugins``: the plugin manager whose ``model_provider`` and transforms to call (a run
    passes its own, so extensions that wrap them take part); default: :func:`model_plugins_of`.
    ``layer_backend``: a backend instance, or the name of one to build for ``parallel``;
    default: the run's ``--layer-backend``. ``transforms``: False builds the plain model
    (the shapes a Hugging Face model's files hold)."""
    if plugins is None:
        plugins = model_plugins_of(config)
    if layer_backend is None or isinstance(layer_backend, str):
        name = layer_backend or selected_driver(config, "layer_backend")
        layer_backend = registry.load("layer_backend", name)(config, parallel)
    names = selected_transforms(config) if transforms else []
    stages = config.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    with building_for(parallel.pipeline_placement):
        for stage in range(stages or 1):
            vp_stage = stage if stages else None
            module = plugins.hook.model_provider(
                config=config, pre_process=parallel.is_pipeline_first_stage(stage),
                post_process=parallel.is_pipeline_last_stage(stage), vp_stage=vp_stage,
                layer_backend=layer_backend, parallel=parallel)
            for name in names:
                before = set(module.state_dict(keep_vars=True))
                changed = transform_caller(plugins, name, names)(
                    config=config, module=module, vp_stage=vp_stage,
                    layer_backend=layer_backend, parallel=parallel)
                if not isinstance(changed, torch.nn.Module):
                    raise PluginError(f"model transform {name!r}: transform_model_chunk "
                                      f"returned {type(changed).__qualname__}, not the "
                                      f"torch.nn.Module chunk to use")
                module = changed
                # What the transform added: a checkpoint of the plain model loads without it.
                for key, tensor in module.state_dict(keep_vars=True).items():
                    if key not in before and added_by_transform(tensor) is None:
                        mark_added_by_transform(tensor, name)
            chunks.append(module)
    return chunks


def reference_model(config: TrainConfig, transforms: bool = False) -> torch.nn.Module:
    """The whole model as one process builds it (no tp, pp, vp, cp or ep: every layer in one
    chunk), on the meta device with a backend that builds anywhere: what a plugin checks its
    names against before launch, where each pipeline stage holds only some layers (LoRA's
    target modules). ``transforms``: also apply the run's model transforms."""
    whole = copy.deepcopy(config)
    p = whole.parallel
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = 1
    p.context_parallel_size = p.expert_model_parallel_size = 1
    p.virtual_pipeline_model_parallel_size = None
    p.expert_tensor_parallel_size = None
    p.sequence_parallel = False
    m = whole.model
    if m.padded_vocab_size is None:  # before launch the vocabulary may not be resolved yet:
        # any size builds the same module names
        m.padded_vocab_size = padded_vocab_size(
            m.vocab_size or m.make_vocab_size_divisible_by, m.make_vocab_size_divisible_by, 1)
    parallel = ParallelContext.build(1, 0, create_groups=False)
    with torch.device("meta"):
        return build_model(whole, parallel, layer_backend=reference_backend(whole),
                           transforms=transforms)[0]


def reference_backend(config) -> str:
    """The layer backend of a single-process reference build (shapes on the meta device,
    ``load_model`` on any device): the run's own when it ``builds_anywhere``, else the first
    installed one that does."""
    names = [selected_driver(config, "layer_backend"),
             *(i.name for i in registry.available("layer_backend"))]
    for name in names:
        try:
            if getattr(registry.load("layer_backend", name), "builds_anywhere", False):
                return name
        except PluginError:
            continue
    raise PluginError("no installed layer backend builds on any device (a LayerBackend with "
                      "builds_anywhere = True, as plugtron's own plain-torch one)")


def model_dtype(config) -> torch.dtype:
    """The dtype the model computes in: bf16 or fp16 under ``--bf16``/``--fp16``, else fp32."""
    if config.training.bf16:
        return torch.bfloat16
    if config.training.fp16:
        return torch.float16
    return torch.float32
