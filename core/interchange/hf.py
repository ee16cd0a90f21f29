"""Hugging Face interchange: ``config.json`` + ``model.safetensors`` to and from a plugtron
checkpoint.

The core does the files; what maps onto what is model-specific and lives in the model's plugin,
found by the model's plugin name in the entry-point group ``plugtron.converters`` (the core
never imports a model). A converter implements :class:`Converter`.
"""

from __future__ import annotations

import os
import sys

import torch
from plugtron.core.checkpoint import state, writer
from plugtron.core.checkpoint.pieces import Box
from plugtron.core.checkpoint.safe_files import (
    check_plain_name,
    read_json_object,
    regular_file_size,
)
from plugtron.core.checkpoint.st_header import read_header
from plugtron.core.config import TrainConfig, derive_padded_vocab_size
from plugtron.core.errors import CheckpointError, ConfigError
from plugtron.core.interchange import hf_strict
from plugtron.core.interchange.converters import converter_for_hf
from plugtron.core.interchange.peft import read_adapter
from plugtron.core.plugins import registry
from plugtron.core.plugins.options import config_from_flags
from safetensors import SafetensorError
from safetensors.torch import load_file


def _plugin_info(role: str, name: str) -> dict:
    info = next((i for i in registry.available(role) if i.name == name), None)
    return {"name": name, "distribution": info.distribution if info else None,
            "version": info.version if info else None}


def read_hf_dir(path: str) -> tuple[dict, dict]:
    """``config.json`` and every tensor of ``model.safetensors`` (or of the shards listed in
    ``model.safetensors.index.json``). The directory is untrusted: shard names must be plain
    file names of regular files in it, and each file's safetensors header is checked against
    its size before it is loaded."""
    if not os.path.lexists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path!r} has no config.json: not a Hugging Face model directory")
    config = read_json_object(path, "config.json")
    index_name = "model.safetensors.index.json"
    if os.path.lexists(os.path.join(path, "model.safetensors")):
        names = ["model.safetensors"]
    elif os.path.lexists(os.path.join(path, index_name)):
        weight_map = read_json_object(path, index_name).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{os.path.join(path, index_name)}: field weight_map must be "
                                  f"an object of tensor name -> file name")
        names = sorted({check_plain_name(v, os.path.join(path, index_name),
                                         f"weight_map[{k!r}]") for k, v in weight_map.items()})
    else:
        raise CheckpointError(f"{path!r} has no model.safetensors (only safetensors weights "
                              f"are read; pickled .bin files never are)")
    tensors = {}
    for name in names:
        regular_file_size(path, name, path, name)
        file = os.path.join(path, name)
        read_header(file)  # offsets and sizes inside the file before safetensors maps it
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file} cannot be read: {exc}") from None
    return config, tensors


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_flags(hf_dir: str, hf_config: dict) -> dict:
    """bos/eos/pad ids of config.json (generation_config.json where config.json has none) as
    plugtron flags. A list of eos ids (Llama 3) keeps its first: plugtron has one eod."""
    sources = [hf_config]
    if os.path.lexists(os.path.join(hf_dir, "generation_config.json")):
        sources.append(read_json_object(hf_dir, "generation_config.json"))
    flags = {}
    for key in SPECIAL_TOKENS:
        value = next((s[key] for s in sources if s.get(key) is not None), None)
        if isinstance(value, list) and value:
            value = value[0]
        if value is None:
            continue
        vocab = hf_config.get("vocab_size")
        if (not isinstance(value, int) or isinstance(value, bool) or value < 0
                or isinstance(vocab, int) and value >= vocab):
            # Some published configs carry e.g. pad_token_id -1; transformers tolerates them.
            print(f"note: {os.path.join(hf_dir, 'config.json')}: field {key} {value!r} is not "
                  f"a token id of the vocabulary; not recorded", file=sys.stderr)
            continue
        flags[key.replace("_", "-")] = value
    return flags


def _resize_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    pad = torch.zeros((rows - tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad])


def import_hf(hf_dir: str, out_dir: str, model: str | None = None,
              dtype: torch.dtype | None = None, peft_adapter: str | None = None
              ) -> tuple[str, TrainConfig, dict]:
    """Convert a Hugging Face model directory into a weights-only plugtron checkpoint at
    ``out_dir`` (iteration 0, no optimizer state); with ``peft_adapter``, a PEFT adapter
    directory trained on it, as the tensors of the model transform that reads it (peft.py).
    Returns (path, the run config it implies, the converter's and the transform's
    ``{flag: value}``)."""
    hf_config, hf_tensors = read_hf_dir(hf_dir)
    converter, model = converter_for_hf(model, hf_config)
    where = os.path.join(hf_dir, "config.json")
    source = hf_strict.SourceTensors(hf_tensors)
    try:
        flags, tensors = converter.import_hf(hf_config, source)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError,
            OverflowError) as exc:
        raise CheckpointError(f"{where} does not describe the weight files "
                              f"({type(exc).__name__}: {exc})") from None
    hf_strict.check_reads(source, converter, flags, hf_dir)
    flags = {**special_token_flags(hf_dir, hf_config), **flags}
    # With the options of the plugins the run selects (an MoE converter sets --num-experts).
    try:
        config = config_from_flags({**flags, "model": model}, "the settings it implies")
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    m = config.model
    if not isinstance(m.vocab_size, int) or m.vocab_size < 1:
        raise CheckpointError(f"{where}: field vocab_size must be a positive integer, got "
                              f"{m.vocab_size!r}")
    padded = derive_padded_vocab_size(config, 1)
    expected = hf_strict.expected_shapes(config, converter.vocab_tensors, flags, where)
    exported = hf_strict.exported_shapes(converter, config, expected,
                                         next(iter(hf_tensors.values())).dtype)
    if exported is not None:
        hf_strict.check_source_shapes(source, exported, m.vocab_size, hf_dir)
    hf_strict.check_model_shapes(tensors, expected, hf_dir)
    if peft_adapter is not None:
        adapter_flags, adapter_tensors = read_adapter(peft_adapter, converter, config, tensors)
        flags = {**flags, **adapter_flags}
        try:
            config = config_from_flags({**flags, "model": model}, "the settings it implies")
        except ConfigError as exc:
            raise ConfigError(f"{peft_adapter}: {exc}") from None
        tensors = {**tensors, **adapter_tensors}
    entries = []
    for name, tensor in sorted(tensors.items()):
        tensor = tensor.to(dtype) if dtype is not None else tensor
        if name in converter.vocab_tensors:
            tensor = _resize_rows(tensor, padded)
        tensor = tensor.contiguous().clone()
        shape = tuple(tensor.shape)
        zeros = (0,) * len(shape)
        entries.append(writer.TensorEntry(f"model/{name}", shape, [(Box(zeros, shape, zeros),
                                                                    tensor)]))
    layout = {"world_size": 1, "tp": 1, "pp": 1, "vp": None, "cp": 1, "ep": 1, "etp": 1,
              "dp": 1}
    metadata = state.base_metadata(config, 0, 0, layout,
                                   {"model": True, "optimizer": False, "rng": False})
    metadata["source"] = {"format": "huggingface", "path": os.path.abspath(hf_dir),
                          "model_type": hf_config.get("model_type"), "flags": flags}
    # Only the model plugin and its converter made this checkpoint; no run selected the others.
    chosen = {"model": model, "converter": model}
    metadata["plugins"] = {role: metadata["plugins"].get(role) or _plugin_info("converter", name)
                           for role, name in chosen.items()}
    return writer.write_single(out_dir, entries, metadata), config, flags
