"""Comparisons with messages that say which run, metric and iteration differ, and by how much.

Every comparison also records the largest difference it saw, passing or not
(:data:`DIFFERENCES`): the kit's pytest plugin prints them under each test's report (``pytest
-rP`` shows them for passing tests, ``-v`` lists them at the end), so an author sees how close a
check came to its tolerance, not only that it held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from plugtron.core.monitoring.metrics import MetricsLogger


@dataclass(frozen=True)
class Difference:
    """The largest difference one comparison saw."""

    what: str
    relative: float  # max |got - want| / |want| (tensors: over the tensor's largest |want|)
    absolute: float  # max |got - want|
    rtol: float
    #: the largest share of its tolerance an element used (1.0: exactly at the tolerance)
    used: float = 0.0

    def __str__(self) -> str:
        return (f"{self.what}: largest relative difference {self.relative:.2e}, absolute "
                f"{self.absolute:.2e}, {self.used:.1%} of the tolerance (rtol {self.rtol:g})")


#: Every comparison's largest difference since the list was last cleared (the pytest plugin
#: clears it before each test).
DIFFERENCES: list[Difference] = []


def _record(what: str, got, want, rtol: float) -> Difference:
    pairs = [(g, w) for g, w in zip(got, want) if g is not None and w is not None]
    rel = max((relative_difference(g, w) for g, w in pairs), default=0.0)
    absolute = max((abs(g - w) for g, w in pairs), default=0.0)
    difference = Difference(what, rel, absolute, rtol, rel / rtol if rtol else 0.0)
    DIFFERENCES.append(difference)
    return difference


def relative_difference(got: float, want: float) -> float:
    """``|got - want| / |want|`` (the denominator at least 1e-12, so a zero reference works)."""
    return abs(got - want) / max(abs(want), 1e-12)


def assert_value_close(got: float | None, want: float | None, rtol: float, what: str
                       ) -> Difference:
    """One number against its reference within relative ``rtol``."""
    difference = _record(what, [got], [want], rtol)
    if got is None or want is None or relative_difference(got, want) > rtol:
        diff = "n/a" if got is None or want is None else f"{relative_difference(got, want):.2e}"
        raise AssertionError(f"{what}: {got!r} vs {want!r} (relative difference {diff} > "
                             f"rtol {rtol:g})")
    return difference


def assert_series_close(got: list, want: list, rtol: float, what: str) -> Difference:
    """Two per-iteration series agree element by element within relative ``rtol``."""
    difference = _record(what, got, want, rtol)
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} iterations against {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None or relative_difference(g, w) > rtol:
            diff = "n/a" if g is None or w is None else f"{relative_difference(g, w):.2e}"
            raise AssertionError(f"{what} at iteration {i + 1}: {g!r} vs {w!r} (relative "
                                 f"difference {diff} > rtol {rtol:g}); got {got}, want {want}")
    return difference


def loss_keys(records: list[dict]) -> list[str]:
    """Every loss a run logged (the model's main loss whatever its report key, other report
    keys, losses added inside the model), then the grad norm."""

    first = records[0] if records else {}
    losses = [k for k, v in first.items()
              if k not in MetricsLogger.STEP_KEYS and isinstance(v, (int, float))]
    return sorted(losses) + ["grad_norm"]


def assert_records_close(got: list[dict], want: list[dict], rtol: float, what: str,
                         keys=None) -> list[Difference]:
    """Per-iteration ``keys`` of two runs' records agree within relative ``rtol``; by default
    every loss the reference run logged and the grad norm. Returns each key's largest
    difference."""
    return [assert_series_close([r.get(key) for r in got], [r.get(key) for r in want], rtol,
                                f"{what}: {key}")
            for key in (loss_keys(want) if keys is None else keys)]


def assert_params_close(got: dict, want: dict, rtol: float, atol: float, what: str
                        ) -> Difference:
    """Same parameter names, and every tensor close (``torch.testing.assert_close``)."""
    if sorted(got) != sorted(want):
        raise AssertionError(f"{what}: parameter names differ: only in the run "
                             f"{sorted(set(got) - set(want))}, only in the reference "
                             f"{sorted(set(want) - set(got))}")
    worst_rel = worst_abs = used = 0.0
    for name in sorted(want):
        g, w = got[name].double(), want[name].double()
        if g.shape == w.shape and g.numel():
            gap = (g - w).abs()
            worst_abs = max(worst_abs, gap.max().item())
            worst_rel = max(worst_rel, gap.max().item() / max(w.abs().max().item(), 1e-12))
            used = max(used, (gap / (atol + rtol * w.abs())).max().item())
    difference = Difference(f"{what}: parameters", worst_rel, worst_abs, rtol, used)
    DIFFERENCES.append(difference)
    for name in sorted(want):
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{what}: parameter {name}: {m}")
    return difference


def assert_copies_match(params: dict, rtol: float, atol: float, what: str) -> dict:
    """Tied copies (``NAME@copy``) equal their original; returns the dict without them."""
    out = {k: v for k, v in params.items() if not k.endswith("@copy")}
    for key, value in params.items():
        if key.endswith("@copy"):
            original = key[: -len("@copy")]
            if original not in out:
                raise AssertionError(f"{what}: {original} has a tied copy but no original")
            torch.testing.assert_close(value, out[original], rtol=rtol, atol=atol,
                                       msg=lambda m, k=original: f"{what}: tied copy of {k} "
                                                                 f"drifted from it: {m}")
    return out
