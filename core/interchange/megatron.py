"""Megatron-Core ``torch_dist`` checkpoints to and from plugtron checkpoints.

The core reads and writes the files (torch_dist.py, with restricted_pickle.py for the pickles);
what maps onto what is the model's: its converter (entry-point group ``plugtron.converters``,
found as for Hugging Face) implements ``import_megatron`` and ``export_megatron``
(:class:`plugtron.core.contracts.converter.ConverterExtras`).
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Mapping

import torch
from plugtron.core.checkpoint import state, writer
from plugtron.core.checkpoint.loader import malformed
from plugtron.core.checkpoint.pieces import Box
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.config import TrainConfig, derive_padded_vocab_size
from plugtron.core.config_flags import flag_fields
from plugtron.core.errors import CheckpointError, ConfigError
from plugtron.core.interchange.converters import (
    converter_for_config,
    converter_for_megatron,
    drop_parts,
    load_converter,
)
from plugtron.core.interchange.hf_export import CheckpointTensors
from plugtron.core.interchange.torch_dist import read_torch_dist, write_torch_dist
from plugtron.core.plugins.options import collect_sections, config_from_dict, config_from_flags
from plugtron.core.plugins.selection import selected_driver

#: Megatron keys that are not model weights: optimizer state, RNG and rerun state (objects),
#: and Transformer Engine's per-module ``_extra_state`` (fp8 scaling history; plugtron has no
#: fp8 state to put it in, and the weights do not depend on it).
SKIPPED_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state")


def _skipped(key: str) -> bool:
    return key.startswith(SKIPPED_PREFIXES) or "_extra_state" in key


def _args_dict(args) -> dict | None:
    if args is None:
        return None
    if isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        args = vars(args)
    if not isinstance(args, dict):
        raise CheckpointError(f"common.pt: 'args' is {type(args).__name__}, not Megatron's "
                              f"argument namespace")
    return args


def _converter(model: str, role: str):
    converter = load_converter(model)
    if not hasattr(converter, role):
        raise ConfigError(f"model plugin {model!r}'s converter cannot {role.replace('_', ' ')} "
                          f"(it has no {role} method)")
    return converter


def import_megatron(src: str, out_dir: str, model: str | None = None, given: dict | None = None,
                    dtype: torch.dtype | None = None) -> tuple[str, TrainConfig]:
    """Convert the model of a Megatron-Core torch_dist checkpoint (``src``: its save directory
    or an ``iter_XXXXXXX`` directory) into a weights-only plugtron checkpoint at ``out_dir``.
    ``model``: the model plugin whose converter reads it (default: the one the installed
    selectors choose, as ``--model auto`` does for training)."""
    if model is None or model == "auto":
        model = selected_driver(TrainConfig(), "model")
    ckpt = read_torch_dist(src)
    args = _args_dict(ckpt.common.get("args"))
    given = {k.lstrip("-").replace("-", "_"): v for k, v in (given or {}).items()}
    typed = config_from_flags({**given, "model": model}, "the model flags given")  # coerces
    sections = model_option_sections(typed)
    fields = {f.name: f.section for f in flag_fields(typed) if f.section in sections}
    given = {k: getattr(sections[fields[k]], k) if k in fields else v for k, v in given.items()}
    converter = converter_for_megatron(model, args, given)
    if not hasattr(converter, "import_megatron"):
        converter = _converter(model, "import_megatron")
    tensors = {k: ckpt.read(k) for k in sorted(ckpt.tensors) if not _skipped(k)}
    names = set(fields)
    flags, out = converter.import_megatron(args, given, tensors, names)
    config = config_from_flags({**flags, "model": model}, f"converted {ckpt.directory!r}")
    m = config.model
    emb = out.get("embedding.word_embeddings.weight")
    rows = emb.shape[0] if emb is not None else None
    if m.vocab_size is None:
        # Megatron saves the padded table; without a saved --vocab-size every row is a token.
        m.vocab_size = rows
    if rows is not None and m.vocab_size > rows:
        raise CheckpointError(f"vocab_size {m.vocab_size} exceeds the {rows} rows of the "
                              f"saved word embeddings")
    padded = derive_padded_vocab_size(config, 1)
    entries = []
    for name in sorted(out):
        tensor = out.pop(name)  # handed over one at a time: the model is held once
        tensor = tensor.to(dtype) if dtype is not None else tensor
        if name in converter.vocab_tensors:
            tensor = _rows(tensor[:m.vocab_size], padded)
        if not _owns_storage(tensor):  # a view keeps its whole base alive; copy it out
            tensor = tensor.contiguous().clone()
        shape = tuple(tensor.shape)
        zeros = (0,) * len(shape)
        entries.append(writer.TensorEntry(f"model/{name}", shape,
                                          [(Box(zeros, shape, zeros), tensor)]))
    layout = {"world_size": 1, "tp": 1, "pp": 1, "vp": None, "cp": 1, "ep": 1, "etp": 1,
              "dp": 1}
    metadata = state.base_metadata(config, 0, 0, layout,
                                   {"model": True, "optimizer": False, "rng": False})
    metadata["source"] = {"format": "megatron-core torch_dist",
                          "path": os.path.abspath(ckpt.directory),
                          "iteration": ckpt.common.get("iteration"),
                          "skipped": sorted(k for k in ckpt.tensors if _skipped(k))[:50]
                          + sorted(ckpt.objects)[:50]}
    return writer.write_single(out_dir, entries, metadata), config


def model_option_sections(config: TrainConfig) -> dict:
    """{section name: section} of the options that define a model: the core's ``model`` and
    the sections the model plugin and its layer types declare (``attention``, ``mlp``...)."""

    declared = {d.section.name for d in collect_sections(config)
                if d.plugin.role in ("model", "layer")}
    return {"model": config.model, **{name: section for name, section
                                      in config.plugin_sections.items() if name in declared}}


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


class _Cast(Mapping):
    """A lazy tensor mapping whose tensors come out in ``dtype`` (cast as each is read)."""

    def __init__(self, tensors: Mapping, dtype: torch.dtype):
        self.tensors, self.dtype = tensors, dtype

    def __getitem__(self, name):
        return self.tensors[name].to(self.dtype)

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def checkpoint_tensors(path: str):
    """(config, lazy {name: full tensor, vocabulary padding removed}, reader) of a checkpoint
    of any layout: each tensor is read when it is looked up, so a converter that builds its
    output one key at a time never holds the model twice."""

    reader = CheckpointReader(path)
    with malformed(reader, "config"):
        config = config_from_dict(reader.config)
    lazy = CheckpointTensors(reader, config, converter_for_config(config).vocab_tensors,
                             master=False)
    return config, lazy, reader


def export_megatron(path: str, out_dir: str, dtype: torch.dtype | None = None, drop=()) -> str:
    """Write the model of plugtron checkpoint ``path`` as a Megatron-Core torch_dist save
    directory ``out_dir`` (``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX``). The
    converter gets the tensors lazily (read and cast on lookup) and builds the saved state one
    key at a time, so the peak is about one model (the state dict torch.distributed.checkpoint
    writes), not two."""
    config, tensors, reader = checkpoint_tensors(path)
    converter = converter_for_config(config)
    drop_parts(converter, config, drop)
    if not hasattr(converter, "export_megatron"):
        raise ConfigError(f"the converter of model {selected_driver(config, 'model')!r} cannot export to "
                          f"Megatron (no export_megatron method)")
    if dtype is not None:
        tensors = _Cast(tensors, dtype)
    padded = derive_padded_vocab_size(config, 1)
    args, out = converter.export_megatron(config, tensors, padded)
    iteration = int(reader.metadata.get("iteration") or 0)
    args.iteration = iteration
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    return write_torch_dist(out_dir, iteration, out, common)
