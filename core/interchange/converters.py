"""Finding the converter of a model and calling it the way it declares (the contract:
:class:`plugtron.core.contracts.converter.Converter`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from plugtron.core.config import TrainConfig
from plugtron.core.contracts.converter import Converter
from plugtron.core.errors import ConfigError
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import (
    implements,
    new_plugin_manager,
    register_transforms,
    transform_caller,
)
from plugtron.core.plugins.selection import TRANSFORM_ROLE, selected_driver


def load_converter(model: str) -> Converter:
    return registry.instantiate(registry.load("converter", model))


def _installed_converter_infos() -> list:
    """(PluginInfo, class) of every converter that loads; a broken one (or one whose
    distribution's requirements are missing) must not break the others."""
    out = []
    for info in registry.available("converter"):
        try:
            out.append((info, registry.load("converter", info.name)))
        except Exception:  # noqa: BLE001 - reported by `plugtron plugins list --check`
            continue
    return out


def converter_for_hf(model: str | None, hf_config: dict) -> tuple[Converter, str]:
    """The installed converter that declares config.json's ``model_type``, and the model
    plugin it imports for; ``model`` (the ``--model`` flag) only chooses among several that do,
    or names the converter to use when the file has no ``model_type``. A type no converter
    declares is refused, listing every installed converter with the types it reads."""
    kind = hf_config.get("model_type")
    infos = _installed_converter_infos()
    readers = [(info, cls) for info, cls in infos if kind in getattr(cls, "model_types", ())]
    if model is not None:
        mine = [(i, c) for i, c in readers if _model_of(i, c) == model]
        if mine:
            return registry.instantiate(mine[0][1]), model
        if kind is None or not readers:
            return load_converter(model), model  # its own message for a type it cannot read
    if readers:
        info, cls = readers[0]
        return registry.instantiate(cls), _model_of(info, cls)
    listing = "; ".join(f"{info.name} ({info.origin}): "
                        f"{', '.join(getattr(cls, 'model_types', ())) or '(by --model only)'}"
                        for info, cls in infos)
    raise ConfigError(f"config.json's model_type {kind!r} is read by no installed converter; "
                      f"installed converters and the types they read: {listing or 'none'} "
                      f"(a converter of another distribution may read it: pip install it)")


def _model_of(info, cls) -> str:
    """The model plugin a converter imports for (``model``, default its own name)."""
    return getattr(cls, "model", None) or info.name


def converter_for_config(config: TrainConfig) -> Converter:
    """An installed converter that claims this run config (``handles``), else its model's."""
    for _, cls in _installed_converter_infos():
        handles = getattr(cls, "handles", None)
        if callable(handles) and handles(config):
            return registry.instantiate(cls)
    return load_converter(selected_driver(config, "model"))


def converter_for_megatron(model: str, args: dict | None, given: dict) -> Converter:
    """An installed converter for ``model`` that claims this Megatron checkpoint
    (``claims_megatron``: its saved args and the settings given), else ``model``'s own."""
    for info in registry.available("converter"):
        try:
            cls = registry.load("converter", info.name)
        except Exception:  # noqa: BLE001 - a broken converter must not break the others
            continue
        claims = getattr(cls, "claims_megatron", None)
        if getattr(cls, "model", info.name) == model and callable(claims) and \
                claims(args, given):
            return registry.instantiate(cls)
    return load_converter(model)


def drop_parts(converter, config: TrainConfig, parts) -> None:
    """Leave ``parts`` out of an export (``--drop``): each must be one the converter offers
    (``droppable_parts``); its ``drop_part`` changes ``config`` accordingly."""
    offered = getattr(converter, "droppable_parts", None) or {}
    for part in parts:
        if part not in offered or not callable(getattr(converter, "drop_part", None)):
            can = (", ".join(f"{name} ({what})" for name, what in offered.items())
                   or "nothing")
            raise ConfigError(f"--drop {part!r}: the converter of this model "
                              f"({type(converter).__name__}) can leave out {can}")
        converter.drop_part(config, part)


def run_export(converter, config: TrainConfig, tensors: Mapping) -> tuple[dict, dict]:
    """The converter's export, called the way it declares (see :class:`Converter` and :class:`ConverterExtras`)."""
    if hasattr(converter, "export_hf_from"):
        return converter.export_hf_from(config, tensors)
    if "config" in inspect.signature(converter.export_hf).parameters:
        return converter.export_hf(config.model, tensors, config=config)
    return converter.export_hf(config.model, tensors)


def plain_model_tensors(config: TrainConfig, tensors: Mapping) -> Mapping:
    """The plain model's tensors of a checkpoint of ``config``, whose run may have applied model
    transforms: each transform folds itself back (hook ``transform_merged_tensors``), the last
    applied first. A transform that cannot is a ``ConfigError`` naming it."""
    pm = new_plugin_manager()
    names = register_transforms(pm, config)
    for name in reversed(names):
        if not implements(pm, f"{TRANSFORM_ROLE}:{name}", "transform_merged_tensors"):
            raise ConfigError(f"the checkpoint's model was changed by model transform {name!r}, "
                              f"which cannot fold itself back into the plain model (it does "
                              f"not implement transform_merged_tensors)")
        tensors = transform_caller(pm, name, names, "transform_merged_tensors")(
            config=config, tensors=tensors)
    return tensors
