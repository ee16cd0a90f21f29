"""plugtron.testing: the conformance kit a plugin author runs in their own repository.

It proves a third-party plugin under every layout exactly as the built-in plugins are proven.
A test calls one function per property::

    from plugtron.testing import assert_layouts_match

    def test_my_model_trains_like_one_process():
        assert_layouts_match({"model": "my-model", "num-layers": 4})

See docs/testing-kit.md for every function, its signature and its tolerance.

Names are imported on first use: pytest imports this package in every session of an
environment where plugtron is installed, and that must not cost a torch import.
"""

from __future__ import annotations

import importlib

#: public name -> submodule that defines it
_EXPORTS = {
    "DistributedPool": "pool", "RankFailure": "pool", "run_on_ranks": "pool",
    "worker_cache": "pool",
    "DEFAULT_FLAGS": "config", "make_config": "config", "world_size_of": "config",
    "RunResult": "runs", "train_losses": "runs", "train_run": "runs",
    "assert_params_close": "compare", "assert_records_close": "compare",
    "DEFAULT_LAYOUTS": "layouts", "assert_layouts_match": "layouts",
    "assert_schedule_matches_1f1b": "schedules",
    "assert_optimizer_dp_equivalent": "optimizers",
    "assert_wrapper_dp_equivalent": "data_parallel",
    "assert_checkpoint_reshards": "checkpoints", "read_checkpoint": "checkpoints",
    "saved_activation_bytes": "activations", "assert_activation_bytes_match": "activations",
    "TRANSFORM_LAYOUTS": "transforms", "assert_transform_conforms": "transforms",
    "assert_merge_matches": "transforms",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
