"""The config a checkpoint was saved with, for plugins that must continue what it started.

A dataset provider runs before the checkpoint is loaded; to resume with exactly the sample
order of the first run (which depends on the sizes that run built its indices for), it reads
the saved config here. Reads ``metadata.json`` only, never tensors.
"""

from __future__ import annotations

import os

from plugtron.core.checkpoint import jsonio, layout


def saved_config(path: str | None) -> dict | None:
    """The config of the checkpoint ``--load path`` resumes from, or ``None`` when there is none
    (no path, or a directory without a complete checkpoint yet)."""
    if not path or not os.path.isdir(path):
        return None
    if not layout.is_checkpoint(path) and not layout.has_checkpoint(path):
        return None
    metadata = jsonio.read_json(os.path.join(layout.resolve_load_path(path), layout.METADATA))
    return metadata.get("config")
