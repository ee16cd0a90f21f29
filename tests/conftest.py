"""Test-wide settings."""

import tempfile

import stevedore._cache as stevedore_cache

# Tests install fake distributions on sys.path and remove them again; stevedore's entry-point
# cache (in memory and on disk, keyed by sys.path) must not carry them into other tests.
stevedore_cache._c._dir = tempfile.mkdtemp(prefix="plugtron-test-entrypoints-")
stevedore_cache._c._disable_caching = True


def forget_entry_points() -> None:
    from stevedore.extension import ExtensionManager

    stevedore_cache._c._internal.clear()
    ExtensionManager.ENTRY_POINT_CACHE.clear()
