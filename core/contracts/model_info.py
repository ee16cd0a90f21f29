"""What the core needs to know about a model without knowing the model (hook ``model_info``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plugtron.core.errors import PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.objects import PluginObject, call_declared
from plugtron.core.plugins.selection import selected_driver

#: The main loss key when a model plugin does not say otherwise (Megatron's).
DEFAULT_MAIN_LOSS = "lm loss"


@dataclass
class ModelInfo:
    """Returned by a model plugin's ``model_info(config)``.

    ``main_loss``: the report key that is the model's loss (progress bar, console, the
    summary's ``final_loss``); every other report key is logged too.
    ``architecture``: ``{flag: effective value}`` of the settings that change tensor shapes or
    what the weights compute; resuming a checkpoint requires them all to agree.
    ``places_layers``: the model decides which layers each pipeline stage holds (e.g. from a
    layer pattern) and checks that split in its ``plugtron_validate``; the core then skips its
    own even-split check of ``--num-layers`` over ``--pp`` x ``--vp``.
    """

    main_loss: str = DEFAULT_MAIN_LOSS
    architecture: dict = field(default_factory=dict)
    places_layers: bool = False


def metric_name(report_key: str) -> str:
    """``"lm loss"`` -> ``"lm_loss"``: report keys as metrics-file keys."""
    return report_key.strip().replace(" ", "_")


def model_info_of(model_plugin, config) -> ModelInfo:
    """The model driver's ``ModelInfo`` (an instance or a plugin object), or the default."""

    plugin = model_plugin if isinstance(model_plugin, PluginObject) else PluginObject(
        "model", "?", "?", model_plugin)
    info = call_declared(plugin, "model_info", config=config)
    return info if isinstance(info, ModelInfo) else ModelInfo()


def model_info_for(config) -> ModelInfo:
    """The ``ModelInfo`` of the model ``config`` selects (the default for an unknown one): what
    an extension asks to describe the run (e.g. its layer count, ``architecture["--num-layers"]``,
    which a pattern-defined model says where ``--num-layers`` is not the truth)."""

    try:
        model = registry.instantiate(registry.load("model", selected_driver(config, "model")))
    except PluginError:
        return ModelInfo()
    return model_info_of(model, config)
