"""Layer backend ``te``: clear errors where transformer-engine or CUDA is missing (checked
everywhere), and a short GPU run against ``local`` (skipped without both)."""

import importlib.util
from unittest import mock

import pytest
import torch
from plugtron.core import registry
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.parallel_context import ParallelContext

from tests.utils import tiny_config, train_in_process

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_GPU = torch.cuda.is_available()


def _build():
    backend_cls = registry.load("layer_backend", "te")  # importable without transformer-engine
    return backend_cls(tiny_config(), ParallelContext.build(1, 0))


def test_te_without_transformer_engine_says_what_to_install():
    with mock.patch("importlib.util.find_spec", return_value=None):
        with pytest.raises(PluginError) as err:
            _build()
    assert "needs transformer-engine" in str(err.value)
    assert "pip install 'transformer-engine[pytorch]'" in str(err.value)


def test_te_without_cuda_says_cuda_is_needed():
    with mock.patch("importlib.util.find_spec", return_value=object()), \
            mock.patch("torch.cuda.is_available", return_value=False):
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            _build()


@pytest.mark.skipif(not (HAVE_TE and HAVE_GPU), reason="needs transformer-engine and a CUDA GPU")
def test_te_trains_like_local_on_one_gpu():
    from plugtron.core.distributed import single_process

    losses = {}
    for backend in ("local", "te"):
        config = tiny_config(layer_backend=backend, train_iters=5, swiglu=True,
                             num_query_groups=2, normalization="RMSNorm")
        records, _ = train_in_process(config, world=single_process("cuda"))
        losses[backend] = [r["lm_loss"] for r in records]
    # TE's GEMMs and fused kernels round differently (TF32 where allowed): a loose tolerance.
    for te_loss, local_loss in zip(losses["te"], losses["local"]):
        assert abs(te_loss - local_loss) <= 1e-2 * abs(local_loss)


def test_cli_rejects_te_before_launching_ranks():
    from click.testing import CliRunner
    from plugtron.cli.main import cli

    with mock.patch("importlib.util.find_spec", return_value=None):
        result = CliRunner().invoke(cli, ["train", "--data", "mock", "--vocab-size", "100",
                                          "--layer-backend", "te", "--nproc-per-node", "2"])
    assert result.exit_code == 2
    assert "needs transformer-engine" in result.output
