"""Model transforms (hook ``transform_model_chunk``) change every chunk wherever a model is
built: a run's chunks (after ``model_provider``, before the data-parallel wrapper), the memory
estimate's meta build, ``load_model``; several in the stated order (named ones first, then
those their own flags turn on); a name that is not installed and a transform that returns no
module are refused, naming them."""

from __future__ import annotations

import pytest
import torch
from plugtron.api import ConfigError, PluginError, load_model
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.selection import selected_transforms
from plugtron.core.tools.estimate import estimate_memory
from plugtron.core.training.builder import build_model
from plugtron.core.training.loop import pretrain, setup
from plugtron.core.training.validate import validate

from tests.transform_helpers import installed_test_transforms
from tests.utils import tiny_config


@pytest.fixture
def transforms(tmp_path):
    with installed_test_transforms(tmp_path / "site") as module:
        yield module


def _built(config) -> torch.nn.Module:
    validate(config, 1)  # the padded vocabulary
    (chunk,) = build_model(config, ParallelContext.build(1, 0, device=torch.device("cpu")))
    return chunk


def test_hook_transform_model_chunk(transforms):
    """A run's chunk is what the transform returned, wrapped for data parallelism after it."""
    run = setup(tiny_config(model_transforms=["record"], train_iters=1),
                world=single_process())
    (chunk,) = run.model_chunks
    assert chunk.module.transformed_by == ["record"]
    assert transforms.CALLS == [("record", None, "cpu")]


def test_named_transforms_first_in_their_order_then_those_their_flags_turn_on(transforms):
    config = tiny_config(model_transforms=["record"], freeze_embedding=True)
    assert selected_transforms(config) == ["record", "freeze"]
    assert _built(config).transformed_by == ["record", "freeze"]
    reordered = tiny_config(model_transforms=["freeze,record"], freeze_embedding=True)
    assert _built(reordered).transformed_by == ["freeze", "record"]
    assert config.plugins.model_transforms == ["record", "freeze"]  # validated: a saved
    # config names what the flags turned on


def test_the_estimate_builds_through_the_transforms_on_the_meta_device(transforms):
    estimate_memory(tiny_config(model_transforms=["record"]), 1)
    assert transforms.CALLS == [("record", None, "meta")]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_the_estimate_counts_frozen_parameters_as_weights_only(transforms, wrapper):
    """The frozen embedding keeps its weights in the count, not its gradients or its Adam
    state (two fp32 values per element): ddp and fsdp2 count the same way."""
    flags = {"data_parallel": wrapper}
    plain = estimate_memory(tiny_config(**flags), 1).ranks[0]
    frozen = estimate_memory(tiny_config(freeze_embedding=True, **flags), 1).ranks[0]
    embedding = (104 + 16) * 32  # word (padded vocabulary) and position embeddings x hidden
    assert frozen.param_bytes == plain.param_bytes
    assert plain.grad_bytes - frozen.grad_bytes == 4 * embedding
    assert plain.optimizer_selected - frozen.optimizer_selected == 2 * 4 * embedding


def test_load_model_builds_the_transformed_model_of_a_checkpoint(transforms, tmp_path):
    pretrain(tiny_config(model_transforms=["record"], train_iters=1, save=str(tmp_path / "ck"),
                         log_interval=0), world=single_process())
    transforms.CALLS.clear()
    model = load_model(str(tmp_path / "ck"))
    assert model.module.transformed_by == ["record"]
    assert transforms.CALLS == [("record", None, "cpu")]


def test_an_unknown_transform_is_refused_naming_those_installed(transforms):
    with pytest.raises(ConfigError, match=r"--model-transforms 'recrod'.*did you mean 'record'"
                                          r".*available: broken"):
        validate(tiny_config(model_transforms=["recrod"]), 1)


def test_a_transform_that_returns_no_module_is_named(transforms):
    with pytest.raises(PluginError, match="model transform 'broken': transform_model_chunk "
                                          "returned str"):
        _built(tiny_config(model_transforms=["broken"]))
