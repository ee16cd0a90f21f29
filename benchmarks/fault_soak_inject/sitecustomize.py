"""Put on PYTHONPATH by benchmarks/fault_soak.py (and its short version in the suite): a full
disk, once. While the file named by ``PLUGTRON_SOAK_DISK_FULL_MARKER`` exists, the next
checkpoint file a rank writes fails with ENOSPC, as on a full disk, and the marker is removed
(the first rank to get there takes it), so the next save succeeds again. Nothing else is
touched."""

import errno
import os

_marker = os.environ.get("PLUGTRON_SOAK_DISK_FULL_MARKER")
if _marker and os.environ.get("RANK") is not None:
    import safetensors.torch as _st

    _real_save_file = _st.save_file

    def _save_file(tensors, filename, *args, **kwargs):
        try:
            os.unlink(_marker)  # only the rank that removes it fails
        except FileNotFoundError:
            return _real_save_file(tensors, filename, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    _st.save_file = _save_file
