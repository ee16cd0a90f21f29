"""Opening the files a checkpoint names, which may come from anyone.

A name from a manifest (or a Hugging Face index) is untrusted: it must be a plain file name
inside the checkpoint directory (no separator, not ``.``/``..``, no NUL), must not be a symlink
(a symlink can leave the directory), and must be a regular file (``/dev/zero`` or a FIFO would
hang any reader). Files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked again with
``fstat`` after opening, so a file swapped for a link or a FIFO in between is still refused and
never blocks. Error messages never describe a file outside the directory (not even its size).
"""

from __future__ import annotations

import json
import os
import stat

from plugtron.core.errors import CheckpointError

#: JSON files of a checkpoint are small; anything bigger is not one of ours (bounds memory).
MAX_JSON_BYTES = 1 << 30


def check_plain_name(name, where: str, field: str) -> str:
    """``name`` if it is a plain file name; ``CheckpointError`` naming ``where`` and ``field``
    otherwise."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: field {field} must be a file name, got {name!r}")
    if ("/" in name or "\\" in name or "\0" in name or name in (".", "..")
            or os.path.isabs(name)):
        raise CheckpointError(f"{where}: field {field} names {name!r}, which is not a plain file "
                              f"name inside the checkpoint directory")
    return name


def regular_file_size(directory: str, name: str, where: str, field: str) -> int:
    """Size of ``directory/name`` after checking it is a plain name of a regular file that is
    not a symlink."""
    check_plain_name(name, where, field)
    path = os.path.join(directory, name)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing ({where}, field {field})"
                              ) from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be examined: {exc.strerror}"
                              ) from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"checkpoint file {path} is a symbolic link ({where}, field "
                              f"{field}); checkpoint files must be regular files inside the "
                              f"checkpoint directory")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"checkpoint file {path} is not a regular file ({where}, field "
                              f"{field})")
    return info.st_size


def open_regular(path: str):
    """A binary file object for ``path``, refusing symlinks and non-regular files without ever
    blocking on them."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    flags |= getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except OSError as exc:  # ELOOP: a symlink
        raise CheckpointError(f"checkpoint file {path} cannot be opened as a regular file "
                              f"({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"checkpoint file {path} is not a regular file")
    return os.fdopen(fd, "rb")


def read_small(path: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a small regular file (a JSON file of the checkpoint)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"checkpoint file {path} is {size} bytes; a checkpoint JSON "
                                  f"file is at most {limit}")
        return f.read(limit + 1)


def read_json_object(path: str, name: str):
    """The JSON object in file ``name`` of directory ``path`` (a Hugging Face directory's
    config, a PEFT adapter's): a plain regular file, small, holding an object."""
    regular_file_size(path, name, path, name)
    file = os.path.join(path, name)
    try:
        data = json.loads(read_small(file))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
    return data
