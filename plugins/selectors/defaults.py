"""Selector ``defaults``: the built-in plugin of each role that a run uses when its flag says
``auto`` and no other selector's flag chose one: the ``adam`` optimizer, the ``local`` layer
backend and the ``text`` dataset. Each is a fallback, so a third party's selector answering a
flag of its own wins over it, and ``--optimizer``/``--layer-backend``/``--data`` NAME always do.

The model's default is not here: plugtron-gpt's selector answers ``gpt``, so without a model
distribution installed ``--model auto`` says that no model is installed.
"""

from __future__ import annotations

from plugtron.api import fallback

#: role -> (config.plugins field, built-in plugin chosen for ``auto``)
DEFAULTS = {"optimizer": ("optimizer", "adam"), "layer_backend": ("layer_backend", "local"),
            "dataset": ("data", "text")}


class BuiltinDefaults:
    """A selector is used as a class: its hooks are static."""

    @staticmethod
    def plugtron_select(role, config):
        if role not in DEFAULTS:
            return None
        field, name = DEFAULTS[role]
        return fallback(name) if getattr(config.plugins, field) == "auto" else None
