"""Which keyword arguments a callable declares: plugtron, like pluggy, passes a plugin method
only the arguments it names.

The answer is cached by code object, never by the callable itself. A cache keyed by the
callable held the run's ``schedule_actions`` hook caller, and through it the plugin manager,
the parallel context and its process groups, for the life of the process: every run in a
long-lived process (a notebook, a test pool's rank) left a set of gloo threads and sockets
behind (tests/distributed/test_run_teardown.py).
"""

from __future__ import annotations

import functools
import inspect

_NOT_ARGUMENTS = ("self", "cls")


def declared_arguments(fn) -> frozenset | None:
    """Names ``fn`` declares (``self``/``cls`` left out); ``None`` when it takes ``**kwargs``
    or its signature cannot be read, i.e. pass everything."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or hasattr(fn, "__wrapped__"):  # a hook caller, a partial, a decorated fn
        return _from_signature(fn)
    return _from_code(code)


@functools.lru_cache(maxsize=512)
def _from_code(code) -> frozenset | None:
    if code.co_flags & inspect.CO_VARKEYWORDS:
        return None
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return frozenset(name for name in names if name not in _NOT_ARGUMENTS)


def _from_signature(fn) -> frozenset | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(name for name in params if name not in _NOT_ARGUMENTS)
