"""What a selector's ``plugtron_select`` answers: a name its flags chose, or a fallback.

A fallback (``plugtron.api.fallback("ddp")``: Megatron's default wrapper when no flag says
otherwise) gives way to any selector whose own flag chose a name; two names chosen by flags, or
two fallbacks, that differ are refused, naming both selectors.
"""

from __future__ import annotations


class Fallback(str):
    """A driver name a selector gives when nothing more specific is asked for."""


def fallback(name: str) -> Fallback:
    return Fallback(name)
