"""Is a layer's ``activation_bytes`` what autograd really keeps?

``plugtron estimate`` and train's memory check add up what each layer says it keeps for
backward (``activation_bytes(shape)``, core/contracts/activations.py). These compare that with the tensors
autograd saves during one forward, the same way the built-in layers are held to it.
"""

from __future__ import annotations

import torch


def saved_activation_bytes(module: torch.nn.Module, *inputs, **kwargs) -> int:
    """Bytes of the distinct storages autograd saves for backward during
    ``module(*inputs, **kwargs)``:
    each storage once (views of one tensor share it), the module's parameters excluded. The
    inputs count: a layer's first op (its norm) is what keeps its input alive."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs, **kwargs)
    return sum(seen.values())


def assert_activation_bytes_match(module: torch.nn.Module, shape, *inputs, rel: float = 0.05,
                                  **kwargs) -> None:
    """``module.activation_bytes(shape)`` within ``rel`` of :func:`saved_activation_bytes`;
    ``inputs`` and ``kwargs`` are one microbatch of ``shape`` (``plugtron.api.ActivationShape``)
    as ``module``'s forward takes it."""
    said = getattr(module, "activation_bytes", None)
    if not callable(said):
        raise AssertionError(f"{type(module).__name__} defines no activation_bytes(shape): "
                             f"plugtron estimate counts its activations as 0")
    said = said(shape)
    said = getattr(said, "stored", said)  # a model chunk may return ChunkActivations
    saved = saved_activation_bytes(module, *inputs, **kwargs)
    if abs(said - saved) > rel * saved:
        raise AssertionError(f"{type(module).__name__}.activation_bytes says {said:,} bytes, "
                             f"autograd saves {saved:,} ({said / max(saved, 1):.3f}x; allowed "
                             f"within {rel:.0%})")
