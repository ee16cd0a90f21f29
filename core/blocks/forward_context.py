"""Per-forward inputs that reach every layer without widening the layer contract.

A layer type's ``forward(hidden, position=None)`` stays as it is; what only some layers need for
one forward pass (document boundaries of packed samples for attention, the KV cache of a
generation step, ...) is set once by the model around its decoder and read where it is used::

    with forward_context(document_ids=batch_doc_ids):
        hidden = self.decoder(hidden, position)

    # inside core attention
    ctx = current_forward_context()
    if ctx.document_ids is not None: ...

The context is a ``contextvars`` value, so nested forwards (a pipeline stage running several
microbatches, a recompute inside backward) each see their own. Code that reruns a forward later
(activation recompute) captures :func:`current_forward_context` at the first run and re-enters
it with :func:`use_forward_context`. New fields are added here, with a default that means
"absent", so existing layers are unaffected.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """``document_ids``: ``[batch, seq]`` integers; a token attends only to earlier tokens with
    the same id (packed documents, Megatron's ``--reset-attention-mask``). ``None``: causal over
    the whole sequence.

    ``inference``: the generation state (KV cache and the offset of this step's tokens), set by
    the generation loop; ``None`` in training.

    ``extras``: a mapping for third-party fields, keyed by the plugin's name."""

    document_ids: Any = None
    inference: Any = None
    extras: dict = dataclasses.field(default_factory=dict)


_EMPTY = ForwardContext()
_CURRENT: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar(
    "plugtron_forward_context", default=_EMPTY)


def current_forward_context() -> ForwardContext:
    """The context of the forward pass running now (all fields absent outside one)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Run a block under ``context`` exactly (re-entering a captured one)."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def forward_context(**fields) -> Iterator[ForwardContext]:
    """Run a block with the current context's ``fields`` replaced; unknown names are a
    ``TypeError`` naming the allowed ones."""
    allowed = {f.name for f in dataclasses.fields(ForwardContext)}
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise TypeError(f"forward_context: unknown field(s) {', '.join(unknown)}; "
                        f"allowed: {', '.join(sorted(allowed))}")
    with use_forward_context(dataclasses.replace(_CURRENT.get(), **fields)) as context:
        yield context
