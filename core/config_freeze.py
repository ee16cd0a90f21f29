"""A validated config is fixed: :func:`freeze` makes every section refuse a change.

Validation derives what the settings imply (the drivers chosen for ``auto``, the schedule's
placement and ``--vp``, the padded vocabulary) and the CLI then freezes the config, in the
launcher and again in each rank, so no plugin or core step can change a setting the run was
validated with. Two writes stay allowed, because they change nothing that was checked:

* the same value again (a rank re-deriving the padded vocabulary for its tp);
* a value for a field that is still ``None``, once (what only the rank can know: the
  tokenizer a dataset falls back to, the sample counts its indices were built for).

A copy (``copy.deepcopy``, a pickle) is not frozen: it is its maker's to change (the memory
estimate's, evaluating one data set at a time).
"""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError
from typing import Any

_FROZEN: dict[type, type] = {}


class ChangedAfterValidation(FrozenInstanceError):
    """A set field of a frozen config was given another value."""


def _refuse_change(self: Any, name: str, value: Any) -> None:
    current = self.__dict__.get(name)
    if current is not None and not _same(current, value):
        raise ChangedAfterValidation(
            f"config field {type(self).__name__}.{name} is {current!r} and cannot become "
            f"{value!r}: the config is fixed once it is validated (derive a value in "
            f"plugtron_validate; keep run state on the plugin, not in its config section)")
    object.__setattr__(self, name, value)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. tensors: compare by identity
        return a is b


def _frozen_class(cls: type) -> type:
    if getattr(cls, "__config_frozen__", False):
        return cls
    if cls not in _FROZEN:
        _FROZEN[cls] = type(cls.__name__, (cls,), {
            "__setattr__": _refuse_change, "__config_frozen__": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__reduce_ex__": _reduce_thawed})
    return _FROZEN[cls]


def _reduce_thawed(self: Any, protocol: Any) -> tuple:
    """Copied or pickled as the plain class with the same fields: a copy is the copier's own to
    change, and a receiver (a rank) freezes what it loads itself."""
    return _rebuild, (type(self).__mro__[1], dict(self.__dict__))


def _rebuild(cls: type, fields: dict) -> Any:
    obj: Any = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _targets(config: Any) -> list:
    return [config, *config.sections().values()]


def freeze(config: Any) -> Any:
    """Make ``config`` (a ``TrainConfig``) and each of its sections refuse changes; returns it."""
    for obj in _targets(config):
        obj.__class__ = _frozen_class(type(obj))
    return config


def is_frozen(config: Any) -> bool:
    return bool(getattr(type(config), "__config_frozen__", False))


def thawed_copy(config: Any) -> Any:
    """A deep copy of ``config`` that may be changed (any copy of a frozen config is)."""
    return copy.deepcopy(config)
