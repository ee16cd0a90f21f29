"""The kit's data-parallel check takes the wrapper's own options (the outsider's local-SGD
wrapper was refused: its options were given to the reference run too, which does not select
the wrapper), and reports the largest difference it saw."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_wrapper_dp_equivalent, compare

from tests.fake_plugins import fake_distribution

WRAPPER = '''
from dataclasses import dataclass

from plugtron.api import ConfigSection, hookimpl, load_plugin, opt


@dataclass
class EveryOptions:
    every_sync_every: int = opt(1, "--every-sync-every", "Sum the gradients every N steps.")


class Every:
    """ddp, with an option of its own (only 1 is exact)."""

    @hookimpl
    def plugtron_config_sections(self):
        return [ConfigSection("every", EveryOptions)]

    @hookimpl
    def plugtron_validate(self, config):
        assert config.every.every_sync_every == 1

    @hookimpl
    def wrap_model_chunk(self, config, module, parallel, shard_gradients):
        ddp = load_plugin("data_parallel", "ddp")()
        return ddp.wrap_model_chunk(config=config, module=module, parallel=parallel,
                                    shard_gradients=shard_gradients)
'''


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    with fake_distribution(tmp_path_factory.mktemp("every"), "plugtron-every",
                           "plugtron.data_parallel", "every=every_wrapper:Every",
                           "every_wrapper", WRAPPER):
        yield


def test_the_wrappers_own_options_go_to_its_run_only(wrapper, rank_pool_factory):
    compare.DIFFERENCES.clear()
    assert_wrapper_dp_equivalent("every", {"every-sync-every": 1}, dp=2,
                                 pool=rank_pool_factory(2))
    seen = {d.what.rsplit(": ", 1)[-1]: d for d in compare.DIFFERENCES}
    assert {"lm_loss", "grad_norm", "parameters"} <= set(seen)
    assert all(d.used <= 1.0 for d in seen.values())
    assert "largest relative difference" in str(seen["lm_loss"])
