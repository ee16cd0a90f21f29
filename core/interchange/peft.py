"""PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``) to and
from a model transform's tensors: ``convert export-hf --adapter-only`` and ``convert import-hf
--peft-adapter``.

The core does the files and finds who answers: the model's converter says which Hugging Face
modules the model's linears are (``hf_linear_map``), a model transform maps its own tensors
(hooks ``transform_peft_adapter`` / ``transform_from_peft_adapter``). Neither the adapter's
kind nor a module name lives here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from plugtron.core.checkpoint.safe_files import read_json_object, regular_file_size
from plugtron.core.checkpoint.st_header import read_header
from plugtron.core.contracts.converter import HFLinearMap
from plugtron.core.errors import CheckpointError, ConfigError
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import (
    implements,
    new_plugin_manager,
    register_driver,
    register_transforms,
    transform_caller,
)
from plugtron.core.plugins.selection import TRANSFORM_ROLE
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def linear_map(converter, config) -> HFLinearMap:
    """The converter's map of the model's linears to Hugging Face modules."""
    make = getattr(converter, "hf_linear_map", None)
    if not callable(make):
        raise ConfigError(f"the converter of this model ({type(converter).__name__}) does not "
                          f"map its linears to Hugging Face modules (hf_linear_map): it writes "
                          f"and reads no PEFT adapters")
    linears: HFLinearMap = make(config)
    return linears


def write_adapter(config, tensors: Mapping, converter, out_dir: str,
                  dtype: torch.dtype | None = None) -> str:
    """The adapter of the transform the checkpoint's run applied, as a PEFT directory (its
    tensors cast to ``dtype`` when given)."""
    linears = linear_map(converter, config)
    pm = new_plugin_manager()
    names = register_transforms(pm, config)
    writers = [n for n in names
               if implements(pm, f"{TRANSFORM_ROLE}:{n}", "transform_peft_adapter")]
    if len(names) != 1 or len(writers) != 1:
        raise ConfigError(f"--adapter-only writes the adapter of a run that applied one model "
                          f"transform with a PEFT form (hook transform_peft_adapter); this "
                          f"checkpoint's run applied {', '.join(names) or 'none'}")
    answer = transform_caller(pm, names[0], names, "transform_peft_adapter")(
        config=config, tensors=tensors, linears=linears)
    if answer is None:
        raise ConfigError(f"--adapter-only: model transform {names[0]!r} has no PEFT form for "
                          f"this checkpoint")
    adapter_config, weights = answer
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"{out_dir!r} exists and is not empty; choose a new directory")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
    # Each tensor its own storage: safetensors refuses shared ones (one A serves q, k and v).
    save_file({k: v.detach().to(dtype or v.dtype).contiguous().clone()
               for k, v in weights.items()},
              os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out_dir


def read_adapter_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter directory's config and tensors (untrusted: plain regular files, the
    safetensors header checked before the file is mapped; pickled .bin files never read)."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.lexists(os.path.join(path, name)):
            raise CheckpointError(f"{path!r} has no {name}: not a PEFT adapter directory "
                                  f"(only safetensors adapters are read)")
        regular_file_size(path, name, path, name)
    adapter_config = read_json_object(path, ADAPTER_CONFIG)
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    read_header(weights)
    try:
        return adapter_config, load_file(weights)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights} cannot be read: {exc}") from None


def read_adapter(path: str, converter, config, base: Mapping) -> tuple[dict, dict]:
    """``(flags, {plugtron name: tensor})`` of the PEFT adapter at ``path`` over the imported
    base (``config``, ``base``): the first installed model transform that reads its kind."""
    adapter_config, tensors = read_adapter_dir(path)
    linears = linear_map(converter, config)
    pm = new_plugin_manager()
    installed = []
    for info in registry.available(TRANSFORM_ROLE):
        try:
            register_driver(pm, TRANSFORM_ROLE, info.name)
        except Exception:  # noqa: BLE001 - reported by `plugtron plugins list --check`
            continue
        installed.append(info.name)
    answer = pm.hook.transform_from_peft_adapter(adapter_config=adapter_config, tensors=tensors,
                                                 linears=linears, base=base)
    if answer is None:
        raise ConfigError(f"{os.path.join(path, ADAPTER_CONFIG)}: peft_type "
                          f"{adapter_config.get('peft_type')!r} is read by no installed model "
                          f"transform (installed: {', '.join(installed) or 'none'})")
    flags, adapter_tensors = answer
    return flags, adapter_tensors
