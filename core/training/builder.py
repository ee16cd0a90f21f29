"""The one model builder: a rank's model chunks, from the model plugin's ``model_provider``.

Training, ``load_model`` (inference), the strict Hugging Face import's shape check and the
memory estimate all build here, so a model plugin is called one way everywhere: one chunk per
virtual pipeline stage, the embedding on the chunk that holds the first stage, the output layer
and loss on the chunk that holds the last (wherever the schedule's placement puts them). Callers choose where the parameters live (a
``torch.device("meta")`` context builds shapes only) and what wraps the chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from plugtron.core.errors import PluginError
from plugtron.core.pipeline.layout import building_for
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import new_plugin_manager
from plugtron.core.plugins.selection import selected_driver

if TYPE_CHECKING:
    import torch
    from plugtron.core.config import TrainConfig
    from plugtron.core.contracts.layer_backend import LayerBackend
    from plugtron.core.parallel.context import ParallelContext


def model_provider_of(config: TrainConfig) -> Callable[..., torch.nn.Module]:
    """The ``model_provider`` hook of ``config``'s model plugin alone (no extensions): for
    builds outside a run, which has its own plugin manager."""
    pm = new_plugin_manager()
    pm.register(registry.instantiate(registry.load("model", selected_driver(config, "model"))), name="model")
    return pm.hook.model_provider


def build_model(config: TrainConfig, parallel: ParallelContext, *,
                provider: Callable[..., torch.nn.Module] | None = None,
                layer_backend: LayerBackend | str | None = None) -> list[torch.nn.Module]:
    """This rank's model chunks, one per virtual pipeline stage (one without ``--vp``).

    ``provider``: the ``model_provider`` hook to call (a run passes its plugin manager's, so
    extensions that wrap it take part); default: :func:`model_provider_of`. ``layer_backend``:
    a backend instance, or the name of one to build for ``parallel``; default: the run's
    ``--layer-backend``."""
    if provider is None:
        provider = model_provider_of(config)
    if layer_backend is None or isinstance(layer_backend, str):
        name = layer_backend or selected_driver(config, "layer_backend")
        layer_backend = registry.load("layer_backend", name)(config, parallel)
    stages = config.parallel.virtual_pipeline_model_parallel_size
    with building_for(parallel.pipeline_placement):
        return [provider(config=config,
                         pre_process=parallel.is_pipeline_first_stage(stage),
                         post_process=parallel.is_pipeline_last_stage(stage),
                         vp_stage=stage if stages else None,
                         layer_backend=layer_backend, parallel=parallel)
                for stage in range(stages or 1)]


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
