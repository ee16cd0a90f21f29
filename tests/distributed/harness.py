"""The multi-process pool the distributed tests use; it lives in the conformance kit now
(:mod:`plugtron.testing.pool`), so third-party plugins test with the same one."""

from plugtron.testing.pool import DistributedPool, RankFailure, run_on_ranks, worker_cache

__all__ = ["DistributedPool", "RankFailure", "run_on_ranks", "worker_cache"]
