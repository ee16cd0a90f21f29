"""Finding the converter of a model and calling it the way it declares (the contract:
:class:`plugtron.core.contracts.converter.Converter`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from plugtron.core.config import TrainConfig
from plugtron.core.contracts.converter import Converter
from plugtron.core.errors import ConfigError
from plugtron.core.plugins import registry


def load_converter(model: str) -> Converter:
    return registry.instantiate(registry.load("converter", model))


def _installed_converters() -> list:
    out = []
    for info in registry.available("converter"):
        try:
            out.append(registry.load("converter", info.name))
        except Exception:  # noqa: BLE001 - a broken converter must not break the others
            continue
    return out


def converter_for_hf(model: str, hf_config: dict) -> Converter:
    """An installed converter that declares this HF ``model_type``, else ``model``'s."""
    kind = hf_config.get("model_type")
    for cls in _installed_converters():
        if kind in getattr(cls, "model_types", ()):
            return registry.instantiate(cls)
    return load_converter(model)


def converter_for_config(config: TrainConfig) -> Converter:
    """An installed converter that claims this run config (``handles``), else its model's."""
    for cls in _installed_converters():
        handles = getattr(cls, "handles", None)
        if callable(handles) and handles(config):
            return registry.instantiate(cls)
    return load_converter(config.plugins.model)


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
