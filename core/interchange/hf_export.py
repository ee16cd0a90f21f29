"""``convert export-hf``: a plugtron checkpoint (any layout) as a Hugging Face directory.

What it writes:

* ``config.json`` from the model's converter, with ``bos_token_id`` / ``eos_token_id`` /
  ``pad_token_id`` (the model's ``--bos-token-id`` etc., recorded from an imported model, else
  the tokenizer's) and ``torch_dtype``; ``generation_config.json`` with the same ids;
* the tokenizer files, when the checkpoint's config names a tokenizer that can save itself
  (``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``);
* the weights as safetensors, sharded by ``max_shard_size`` with
  ``model.safetensors.index.json`` (hf_write.py), read from the checkpoint one tensor at a time
  as the converter asks for them and written one at a time;
* with ``dtype=float32`` from a bf16/fp16 run, the optimizer's fp32 master weights where the
  checkpoint has them (``optim/<name>/main_param``), not the rounded model weights;
* the plain model: the tensors of the run's model transforms folded back in (LoRA's adapters
  merged into their linears, hook ``transform_merged_tensors``); a fine-tune's checkpoint that
  holds only what it trained is read over the base it names;
* with ``adapter_only``, instead: the transform's adapter as a PEFT directory
  (``adapter_config.json``, ``adapter_model.safetensors``; peft.py) for the Hugging Face export
  of the plain base model.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

import torch
from plugtron.core.checkpoint import base
from plugtron.core.checkpoint.loader import malformed
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.errors import CheckpointError, ConfigError
from plugtron.core.interchange.converters import (
    converter_for_config,
    drop_parts,
    plain_model_tensors,
    run_export,
)
from plugtron.core.interchange.hf_write import DEFAULT_MAX_SHARD_SIZE, parse_size, write_weights
from plugtron.core.interchange.peft import write_adapter
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.plugins.tokenizers import build_tokenizer

SPECIAL = ("bos", "eos", "pad")


class CheckpointTensors(Mapping):
    """A checkpoint's full model tensors, read on demand (vocabulary padding removed); with
    ``master`` the fp32 master copy of each parameter the optimizer saved."""

    def __init__(self, reader: CheckpointReader, config, vocab_tensors, master: bool):
        self.reader, self.config, self.vocab_tensors = reader, config, set(vocab_tensors)
        self.names = reader.names("model/")
        optim = set(reader.names("optim/")) if master else set()
        self.master = {n for n in self.names if f"{n}/main_param" in optim}
        self.missing_master = master and len(self.master) < len(self.names)

    def __getitem__(self, name):
        if name not in self.names:
            raise KeyError(name)
        key = f"optim/{name}/main_param" if name in self.master else f"model/{name}"
        tensor = self.reader.read_full(key)
        if name in self.vocab_tensors:
            tensor = tensor[:self.config.model.vocab_size]
        return tensor

    def __contains__(self, name):
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


class Layered(Mapping):
    """A fine-tune's tensors over its base's: a name the first lacks comes from the second."""

    def __init__(self, own: Mapping, base: Mapping):
        self.own, self.base = own, base

    def __getitem__(self, name):
        return self.own[name] if name in self.own else self.base[name]

    def __contains__(self, name):
        return name in self.own or name in self.base

    def __iter__(self):
        return iter([*self.own, *(n for n in self.base if n not in self.own)])

    def __len__(self):
        return sum(1 for _ in self)


def special_ids(config, tokenizer=None) -> dict:
    """``{bos_token_id: .., eos_token_id: .., pad_token_id: ..}`` known for this model: its
    own settings, else the tokenizer's."""
    m = config.model
    ids = {f"{k}_token_id": getattr(m, f"{k}_token_id", None) for k in SPECIAL}
    if tokenizer is not None:
        for k in SPECIAL:
            if ids[f"{k}_token_id"] is None:
                ids[f"{k}_token_id"] = getattr(tokenizer, k, None)
    return {k: v for k, v in ids.items() if v is not None}


def _tokenizer(config):
    data = config.data
    if not data.tokenizer_type:
        return None

    return build_tokenizer(data.tokenizer_type, data.tokenizer_model, config.model.vocab_size)


def _write_json(out_dir: str, name: str, data: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def export_hf(path: str, out_dir: str, dtype: torch.dtype | None = None,
              max_shard_size=None, drop=(), adapter_only: bool = False) -> str:
    shard_bytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)  # checked first
    reader = CheckpointReader(path)
    with malformed(reader, "config"):
        config = config_from_dict(reader.config)
    tokenizer = _tokenizer(config)
    converter = converter_for_config(config)
    drop_parts(converter, config, drop)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"{out_dir!r} exists and is not empty; choose a new directory")
    low_precision = config.training.bf16 or config.training.fp16
    own = CheckpointTensors(reader, config, converter.vocab_tensors,
                            master=dtype == torch.float32 and low_precision)
    tensors: Mapping = own
    base_info = reader.metadata.get(base.BASE_KEY)
    if base_info:  # a fine-tune's checkpoint: its base holds the rest of the model
        base_reader = CheckpointReader(base_info["path"])
        if base.identity(base_reader)["fingerprint"] != base_info.get("fingerprint"):
            raise CheckpointError(f"{path} was fine-tuned from {base_info['path']}, which has "
                                  f"changed since (its metadata differ)")
        tensors = Layered(tensors, CheckpointTensors(base_reader, config, converter.vocab_tensors,
                                                     master=False))
    if adapter_only:
        with malformed(reader, "config.model"):
            write_adapter(config, tensors, converter, out_dir, dtype)
        reader.close()
        return out_dir
    if own.missing_master:
        print(f"note: {path} has no fp32 master copy of "
              f"{len(own.names) - len(own.master)} model tensor(s) (a weights-only "
              f"checkpoint, or buffers); those are exported from the model weights",
              file=sys.stderr)
    with malformed(reader, "config.model"):
        hf_config, hf_tensors = run_export(converter, config, plain_model_tensors(config,
                                                                                  tensors))
    ids = special_ids(config, tokenizer)
    hf_config.update(ids)
    hf_config["torch_dtype"] = str(dtype or next(iter(hf_tensors.values())).dtype
                                   ).removeprefix("torch.")
    os.makedirs(out_dir, exist_ok=True)
    _write_json(out_dir, "config.json", hf_config)
    _write_json(out_dir, "generation_config.json", {**ids, "_from_model_config": True})
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(out_dir)
    # Handed over, not copied: write_weights empties the dict, freeing each tensor once written.
    write_weights(out_dir, hf_tensors, dtype, shard_bytes)
    reader.close()
    return out_dir
