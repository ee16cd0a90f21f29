"""Model transforms for the tests, installed as a fake distribution (no pip): ``record`` notes
each call, ``freeze`` freezes the embedding and is turned on by its own flag
(``--freeze-embedding``), ``broken`` returns no module."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import sys

from tests.fake_plugins import install_fake_distribution, remove_path

MODULE = "plugtron_test_transforms"

SOURCE = '''
from dataclasses import dataclass

from plugtron.api import ConfigSection, hookimpl, opt

#: (transform, vp_stage, device type of the chunk's parameters, model_transforms of the config)
CALLS = []


def _mark(module, name):
    module.transformed_by = [*getattr(module, "transformed_by", []), name]
    return module


class Record:
    @hookimpl
    def transform_model_chunk(self, config, module, vp_stage, layer_backend, parallel):
        CALLS.append(("record", vp_stage, next(module.parameters()).device.type))
        return _mark(module, "record")


@dataclass
class FreezeOptions:
    freeze_embedding: bool = opt(False, "--freeze-embedding",
                                 "Freeze the embedding (a test transform).", is_flag=True)


class FreezeEmbedding:
    @staticmethod
    def plugtron_config_sections():
        return [ConfigSection("freeze_test", FreezeOptions)]

    @staticmethod
    def plugtron_select(role, config):
        on = getattr(config, "freeze_test", FreezeOptions()).freeze_embedding
        return "freeze" if role == "model_transform" and on else None

    @hookimpl
    def transform_model_chunk(self, module, vp_stage):
        CALLS.append(("freeze", vp_stage, next(module.parameters()).device.type))
        for name, param in module.named_parameters():
            if "embedding" in name:
                param.requires_grad_(False)
        return _mark(module, "freeze")


class Broken:
    @hookimpl
    def transform_model_chunk(self, module):
        return "not a module"
'''


@contextlib.contextmanager
def installed_test_transforms(root: pathlib.Path):
    """The three transforms installed for the ``with`` block; yields their module (its
    ``CALLS``, emptied first)."""
    install_fake_distribution(root, "plugtron-test-transforms", "0.1.0", {
        "plugtron.model_transforms": {"record": f"{MODULE}:Record",
                                      "freeze": f"{MODULE}:FreezeEmbedding",
                                      "broken": f"{MODULE}:Broken"}}, {MODULE: SOURCE})
    try:
        module = importlib.import_module(MODULE)
        module.CALLS.clear()
        yield module
    finally:
        sys.modules.pop(MODULE, None)
        remove_path(root)
