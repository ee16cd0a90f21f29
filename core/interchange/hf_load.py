"""``--load HF_DIR``: a Hugging Face model directory used where a checkpoint is expected.

The directory is imported once (strictly, :mod:`.hf_strict`) into a cache checkpoint keyed by
what it holds (names, sizes and modification times of its files, the model plugin and the
plugtron version), and the run then loads that checkpoint. The model settings come from the
import; a flag or config-file value that contradicts them is refused, naming both.

The cache lives under ``$PLUGTRON_HF_CACHE`` (default ``~/.cache/plugtron/hf``). Each import is
written to a private temporary directory and renamed into place, so ranks that start at once
(under torchrun) never read a half-written one; the loser of the rename discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from plugtron.core.checkpoint import layout
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.checkpoint.state import plugtron_version
from plugtron.core.config_flags import FlagField, flag_fields
from plugtron.core.errors import ConfigError
from plugtron.core.interchange.hf import import_hf
from plugtron.core.plugins.options import config_from_dict


def is_hf_dir(path: str | None) -> bool:
    """A directory with a ``config.json`` that is not a plugtron checkpoint (nor a directory
    of them)."""
    return path is not None and os.path.isdir(path) and os.path.isfile(
        os.path.join(path, "config.json")) and not layout.has_checkpoint(path)


def cache_root() -> str:
    return os.environ.get("PLUGTRON_HF_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "plugtron", "hf")


def _key(hf_dir: str, model: str | None) -> str:

    digest = hashlib.sha256(json.dumps([os.path.abspath(hf_dir), model,
                                        plugtron_version()]).encode())
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith((".json", ".safetensors")):
            info = os.lstat(os.path.join(hf_dir, name))
            digest.update(f"{name}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:24]


def import_cached(hf_dir: str, model: str | None = None) -> str:
    """The path of the cached plugtron checkpoint of ``hf_dir`` (imported now if needed; the
    converter is the installed one that reads its config.json's model_type, ``model`` choosing
    between two)."""

    target = os.path.join(cache_root(), _key(hf_dir, model))
    if layout.is_checkpoint(target):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import_hf(hf_dir, tmp, model)
        try:
            os.rename(tmp, target)
        except OSError:  # another rank renamed its copy first
            if not layout.is_checkpoint(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def hf_base(hf_dir: str, model: str | None = None):
    """``(run config of the imported model with --load set to its cache checkpoint, the
    converter's {flag: value})``."""
    path = import_cached(hf_dir, model)
    reader = CheckpointReader(path)
    try:
        config = config_from_dict(reader.config)
        flags = dict((reader.metadata.get("source") or {}).get("flags") or {})
    finally:
        reader.close()
    config.checkpoint.load = path
    config.model.padded_vocab_size = None  # recomputed for the run's tp
    return config, flags


def check_agrees(config, base, flags: dict, hf_dir: str) -> None:
    """Every setting the import fixed has the same value in the run config ``config``."""

    by_flag: dict[str, FlagField] = {}
    for field in flag_fields(config):
        for spelling in (field.flag, *field.aliases):
            by_flag[spelling.lstrip("-")] = field
    for key in sorted(flags):
        given = by_flag.get(key)
        if given is None:
            continue
        ours = getattr(getattr(config, given.section), given.name)
        theirs = getattr(getattr(base, given.section), given.name)
        if ours != theirs:
            raise ConfigError(
                f"{given.flag} {ours!r} contradicts {os.path.join(hf_dir, 'config.json')}, "
                f"which gives {given.flag} {theirs!r}; the model settings of --load HF_DIR "
                f"come from its config.json (drop the flag, or convert and edit the model)")
