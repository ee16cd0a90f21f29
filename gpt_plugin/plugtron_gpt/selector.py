"""Selector ``gpt``: plugtron-gpt's GPT is the model of a run that says ``--model auto`` (the
default), as Megatron-LM's pretrain_gpt.py trains a GPT unless told otherwise. A fallback: a
selector whose own flag chooses a model wins over it."""

from __future__ import annotations

from plugtron.api import fallback


class GptDefault:
    """A selector is used as a class: its hooks are static."""

    @staticmethod
    def plugtron_select(role, config):
        if role == "model" and config.plugins.model == "auto":
            return fallback("gpt")
        return None
