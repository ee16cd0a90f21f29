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
import sys

from plugtron.core.checkpoint.safe_files import read_small
from plugtron.core.errors import CheckpointError

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


def _is_real_dir(parent: str, name: str) -> bool:
    """``parent/name`` is a directory of ``parent`` itself: not a symlink, not resolving
    elsewhere (a checkpoint directory from anyone may hold ``iter_X -> /elsewhere``)."""
    path = os.path.join(parent, name)
    if os.path.islink(path):
        return False
    return os.path.dirname(os.path.realpath(path)) == os.path.realpath(parent)


def complete_checkpoints(parent: str) -> list[tuple[int, str]]:
    """(iteration, path) of every renamed-into-place checkpoint under ``parent``, oldest first.
    Temporary directories of interrupted saves and symlinked iteration directories are not
    listed."""
    out = []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    for name in names:
        match = _ITER_RE.match(name)
        path = os.path.join(parent, name)
        if match and _is_real_dir(parent, name) and is_checkpoint(path):
            out.append((int(match.group(1)), path))
    return sorted(out)


def read_latest(parent: str) -> str | None:
    """The directory name ``parent/latest`` holds; None when there is no ``latest``. Read
    through the safe readers: a FIFO or device named ``latest`` would block a plain open()."""

    path = os.path.join(parent, LATEST)
    if not os.path.lexists(path):
        return None
    text = read_small(path, 256).decode(errors="replace").strip()
    if not text:
        return None
    if not _ITER_RE.match(text):
        raise CheckpointError(f"{path} holds {text[:40]!r}; it must name a checkpoint "
                              f"directory iter_XXXXXXX of {parent}")
    return text


def iteration_of(name: str) -> int | None:
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def moved_aside(parent: str, name: str) -> str | None:
    """A complete old copy of ``parent/name`` that a re-save moved aside (``name.old-PID``)
    and did not remove yet: the save crashed between its two renames."""
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return None
    for other in names:
        if other.startswith(name + ".old-") and other[len(name) + 5:].isdigit():
            path = os.path.join(parent, other)
            if _is_real_dir(parent, other) and is_checkpoint(path):
                return path
    return None


def load_candidates(path: str) -> tuple[bool, list[str]]:
    """What ``--load path`` may mean, best first: (explicit, paths). ``path`` itself when it
    is a checkpoint (explicit: it must load or fail). Otherwise the checkpoints inside it,
    newest first, starting from the one ``latest`` names: checkpoints newer than that were
    written by another run into the same directory and are never resumed from. When ``latest``
    names a directory that a re-save moved aside and a crash left there (systems without an
    atomic directory exchange, see writer.commit), that old copy is the one loaded."""
    if is_checkpoint(path):
        return True, [path]
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {path!r}: no such directory")
    latest = read_latest(path)
    limit = iteration_of(latest) if latest else None
    for name in os.listdir(path):
        if (_ITER_RE.match(name) and not _is_real_dir(path, name)
                and (limit is None or (iteration_of(name) or 0) <= limit)):
            raise CheckpointError(f"--load {path!r}: {name} is a symbolic link or lies outside "
                                  f"the directory; iteration directories must be directories "
                                  f"inside it")
    found = complete_checkpoints(path)
    if limit is not None:
        found = [(i, p) for i, p in found if i <= limit]
    paths = [p for _, p in reversed(found)]
    if latest and not is_checkpoint(os.path.join(path, latest)):
        old = moved_aside(path, latest)
        if old is not None:
            paths.insert(0, old)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"warning: {os.path.join(path, LATEST)} names {latest}, which is missing or "
                  f"incomplete (a save was interrupted); loading "
                  f"{os.path.basename(paths[0]) if paths else 'nothing'} instead",
                  file=sys.stderr, flush=True)
    if not paths:
        raise CheckpointError(f"--load {path!r}: no complete checkpoint in it (a checkpoint is a "
                              f"directory with {METADATA}, or iter_XXXXXXX directories of them)")
    return False, paths


def resolve_load_path(path: str) -> str:
    """The checkpoint directory ``--load path`` means first (see :func:`load_candidates`)."""
    return load_candidates(path)[1][0]


def has_checkpoint(path: str) -> bool:
    return is_checkpoint(path) or bool(complete_checkpoints(path))
