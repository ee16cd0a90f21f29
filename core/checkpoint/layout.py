"""Names on disk: the directories and files of a checkpoint, and finding the one to load.

```
SAVE_DIR/
  latest                      text: the directory name of the newest complete checkpoint
  iter_0000005/               one complete checkpoint
    metadata.json             written last; lists every rank manifest with its digest
    rank_00000.json           per global rank: pieces it wrote, file digests, RNG state
    model_rank_00000.safetensors
    optim_rank_00000.safetensors
  .tmp-iter_0000010/          a checkpoint being written (ignored when loading)
```
"""

from __future__ import annotations

import os
import re

from ..errors import CheckpointError

METADATA = "metadata.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tmp_dirname(iteration: int) -> str:
    return TMP_PREFIX + iteration_dirname(iteration)


def manifest_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def tensor_file_name(kind: str, rank: int) -> str:
    return f"{kind}_rank_{rank:05d}.safetensors"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def complete_checkpoints(parent: str) -> list[tuple[int, str]]:
    """(iteration, path) of every renamed-into-place checkpoint under ``parent``, oldest first.
    Temporary directories of interrupted saves are not listed."""
    out = []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    for name in names:
        match = _ITER_RE.match(name)
        path = os.path.join(parent, name)
        if match and is_checkpoint(path):
            out.append((int(match.group(1)), path))
    return sorted(out)


def read_latest(parent: str) -> str | None:
    try:
        with open(os.path.join(parent, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def iteration_of(name: str) -> int | None:
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def load_candidates(path: str) -> tuple[bool, list[str]]:
    """What ``--load path`` may mean, best first: (explicit, paths). ``path`` itself when it
    is a checkpoint (explicit: it must load or fail). Otherwise the checkpoints inside it,
    newest first, starting from the one ``latest`` names: checkpoints newer than that were
    written by another run into the same directory and are never resumed from."""
    if is_checkpoint(path):
        return True, [path]
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {path!r}: no such directory")
    found = complete_checkpoints(path)
    latest = read_latest(path)
    limit = iteration_of(latest) if latest else None
    if limit is not None:
        found = [(i, p) for i, p in found if i <= limit]
    if not found:
        raise CheckpointError(f"--load {path!r}: no complete checkpoint in it (a checkpoint is a "
                              f"directory with {METADATA}, or iter_XXXXXXX directories of them)")
    return False, [p for _, p in reversed(found)]


def resolve_load_path(path: str) -> str:
    """The checkpoint directory ``--load path`` means first (see :func:`load_candidates`)."""
    return load_candidates(path)[1][0]


def has_checkpoint(path: str) -> bool:
    return is_checkpoint(path) or bool(complete_checkpoints(path))
