"""One test per hook (``test_hook_<name>``): the built-in plugins honour each contract, and
lifecycle hooks fire at their documented points."""

from __future__ import annotations

import pytest
import torch
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.errors import PluginError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins import registry
from plugtron.core.plugins.manager import (
    build_plugin_manager,
    optimizer_state_per_param,
    wants_sharded_gradients,
)
from plugtron.core.training.loop import finalize_model_config, setup, split_sizes
from plugtron.core.training.optimizer import StepResult

from tests.fake_plugins import install_fake_distribution, remove_path
from tests.utils import tiny_config, train_in_process


def _pm(config):
    return build_plugin_manager(config)


def _built(config=None):
    config = config or tiny_config()
    run = setup(config, world=single_process())
    return config, run


def test_hook_dataset_provider():
    config = tiny_config()
    pm = _pm(config)
    train, valid, test = pm.hook.dataset_provider(config=config, split_sizes=(16, 8, 8),
                                                  parallel=None)
    assert len(train) >= 16
    sample = train[0]
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (config.model.seq_length,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def test_hook_model_provider():
    config = tiny_config()
    parallel = ParallelContext.build(1, 0)
    pm = _pm(config)
    pm.hook.dataset_provider(config=config, split_sizes=split_sizes(config), parallel=parallel)
    finalize_model_config(config, parallel)
    backend = registry.load("layer_backend", "local")(config, parallel)
    model = pm.hook.model_provider(config=config, pre_process=True, post_process=True,
                                   vp_stage=None, layer_backend=backend, parallel=parallel)
    tokens = torch.randint(0, 100, (2, 16))
    logits = model(tokens, torch.arange(16).expand(2, 16))
    assert logits.shape == (2, 16, config.model.padded_vocab_size)
    middle = pm.hook.model_provider(config=config, pre_process=False, post_process=False,
                                    vp_stage=None, layer_backend=backend, parallel=parallel)
    hidden = torch.randn(2, 16, config.model.hidden_size)
    middle.set_input_tensor(hidden)
    assert middle(tokens, None).shape == hidden.shape


def test_hook_forward_step():
    config, run = _built()
    iterator = iter([{k: v.unsqueeze(0) for k, v in run.datasets[0][0].items()}])
    output, closure = run.forward_step_func(iterator, run.model_chunks[0])  # bound to loss_func
    assert output.shape == (1, config.model.seq_length)  # per-token losses on the last stage
    loss_sum, num_tokens, report = closure(output)
    assert num_tokens.item() == config.model.seq_length
    assert torch.allclose(loss_sum, output.sum())
    assert torch.allclose(report["lm loss"], torch.stack([loss_sum, num_tokens]).detach())


def test_hook_loss_func():
    config, run = _built()
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    loss_sum, num_tokens, report = run.pm.hook.loss_func(loss_mask=mask, output_tensor=losses)
    assert loss_sum.item() == 4.0 and num_tokens.item() == 2.0
    assert report["lm loss"].tolist() == [4.0, 2.0]


def test_hook_forward_backward():
    config, run = _built()
    from plugtron.core.training.loop import data_iterators, run_schedule

    reports = run_schedule(run, data_iterators(run, run.datasets[0], 0), forward_only=False)
    assert len(reports) == run.num_microbatches == 4
    assert all(r["num_tokens"].item() == 2 * 16 for r in reports)
    from plugtron.core.training.grads import grad_of

    # Gradients accumulate into the data-parallel buffer (main_grad).
    assert all(grad_of(p) is not None and grad_of(p).abs().sum() > 0
               for p in run.model_chunks[0].parameters())


def test_hook_schedule_actions():
    config = tiny_config()
    pm = _pm(config)
    actions = pm.hook.schedule_actions(pp_rank=0, pp_size=1, num_chunks=1, num_microbatches=2,
                                       config=config)
    assert [str(a) for a in actions] == ["F0", "B0", "F1", "B1"]


def test_hook_build_optimizer():
    config, run = _built()
    groups = run.optimizer.param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, param in run.model_chunks[0].module.named_parameters():
        if param.ndim == 1 or name.endswith(".bias"):
            assert id(param) not in decayed, f"{name} must not be decayed"
    for p in run.model_chunks[0].parameters():
        p.main_grad.fill_(1.0)  # the data-parallel buffer the optimizer reads
    result = run.optimizer.step()
    assert isinstance(result, StepResult) and result.stepped and result.grad_norm > 0


TORCH_OPTIMIZER_PLUGIN = """
import torch
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.training.optimizer import named_params

class BareSGD:
    @hookimpl
    def build_optimizer(self, config, model_chunks):
        return torch.optim.SGD([p for _, p in named_params(model_chunks)], lr=0.1)
"""


def test_build_optimizer_must_return_an_optimizer(tmp_path):
    install_fake_distribution(tmp_path, "bare-optimizers", "0.9",
                              {"plugtron.optimizers": {"bare-sgd": "bare_sgd:BareSGD"}},
                              {"bare_sgd": TORCH_OPTIMIZER_PLUGIN})
    try:
        with pytest.raises(PluginError) as err:
            setup(tiny_config(optimizer="bare-sgd"), world=single_process())
    finally:
        remove_path(tmp_path)
    assert str(err.value) == (
        "optimizer 'bare-sgd' from bare-optimizers 0.9: build_optimizer returned "
        "torch.optim.sgd.SGD, not a plugtron.core.training.optimizer.Optimizer (subclass it, or wrap a "
        "torch optimizer in plugtron.core.training.optimizer.TorchOptimizer)")


def test_hook_optimizer_shards_gradients():
    # No implementation means no: adam's buffers are all-reduced whole.
    config, run = _built()
    assert run.pm.hook.optimizer_shards_gradients(config=config) is None
    assert not wants_sharded_gradients(config, run.pm)
    assert not run.model_chunks[0].sharded
    # distributed-adam says yes, so the core builds sharded buffers before the optimizer.
    config, run = _built(tiny_config(use_distributed_optimizer=True))
    assert run.pm.hook.optimizer_shards_gradients(config=config) is True
    assert run.model_chunks[0].sharded
    # Before launch (validation): a plugin manager of the selected optimizer alone answers.
    assert wants_sharded_gradients(tiny_config(optimizer="distributed-adam"))
    assert not wants_sharded_gradients(tiny_config(optimizer="sgd"))


def test_hook_optimizer_shards_layer_wise():
    # No implementation means no (adam shards by element ranges, as distributed-adam); muon
    # answers yes when the run asks for a sharded optimizer, and its buffers stay whole.
    from plugtron.api import LayerWiseOptimizer, optimizer_shards_layer_wise

    assert not optimizer_shards_layer_wise(tiny_config(use_distributed_optimizer=True))
    assert not optimizer_shards_layer_wise(tiny_config(optimizer="muon"))
    config, run = _built(tiny_config(optimizer="muon", use_distributed_optimizer=True))
    assert run.pm.hook.optimizer_shards_layer_wise(config=config) is True
    assert isinstance(run.optimizer, LayerWiseOptimizer)
    assert not run.model_chunks[0].sharded


def test_hook_optimizer_state_per_param():
    # The built-in optimizers answer through the run's plugin manager and before launch alike.
    # Asked per parameter: Muon keeps one value for its matrices, AdamW's two for the rest.
    config, run = _built()
    name, param = next(iter(run.model_chunks[0].named_parameters()))
    assert run.pm.hook.optimizer_state_per_param(config=config, name=name, param=param) == 2
    matrix, bias = torch.empty(4, 4, device="meta"), torch.empty(4, device="meta")
    for optimizer, flags, want in (("distributed-adam", {}, (2, 2)), ("sgd", {}, (1, 1)),
                                   ("sgd", {"sgd_momentum": 0.0}, (0, 0)),
                                   ("muon", {}, (1, 2)),
                                   ("muon", {"muon_scalar_optimizer": "lion"}, (1, 1))):
        values = optimizer_state_per_param(tiny_config(optimizer=optimizer, **flags))
        assert values is not None
        assert (values("w", matrix), values("b", bias)) == want, (optimizer, flags)


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def plugtron_configure(self, config):
        self.calls.append("configure")

    @hookimpl
    def plugtron_process_groups_ready(self, parallel):
        self.calls.append("groups")

    @hookimpl
    def plugtron_model_built(self, config, model_chunks, parallel):
        self.calls.append("model")

    @hookimpl
    def plugtron_train_start(self, config, state):
        self.calls.append("start")

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        self.calls.append(f"step{iteration}")

    @hookimpl
    def plugtron_train_end(self, config, state, summary):
        self.calls.append("end")


def _lifecycle_calls():
    from plugtron.core.training.loop import pretrain

    recorder = Recorder()
    pretrain(tiny_config(train_iters=2), extra_plugins=[recorder], world=single_process())
    return recorder.calls


def test_hook_plugtron_configure():
    assert _lifecycle_calls()[0] == "configure"


def test_hook_plugtron_process_groups_ready():
    # Historic: a plugin registered after the groups were built still hears about them.
    assert "groups" in _lifecycle_calls()


def test_hook_plugtron_model_built():
    calls = _lifecycle_calls()
    assert calls.index("model") < calls.index("start")


def test_hook_plugtron_train_start():
    calls = _lifecycle_calls()
    assert calls.index("start") < calls.index("step1")


def test_hook_plugtron_step_end():
    records, _ = train_in_process(tiny_config(train_iters=3), world=single_process())
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert {"lm_loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s",
            "consumed_samples"} <= set(records[0])


def test_hook_plugtron_evaluation_end():
    """Fires after each evaluation with the metrics file's valid_* line."""
    from plugtron.core.training.loop import pretrain

    class Evaluations:
        def __init__(self):
            self.calls = []

        @hookimpl
        def plugtron_evaluation_end(self, iteration, metrics):
            self.calls.append((iteration, dict(metrics)))

    heard = Evaluations()
    pretrain(tiny_config(train_iters=4, eval_interval=2, eval_iters=1), extra_plugins=[heard],
             world=single_process())
    assert [it for it, _ in heard.calls] == [2, 4]
    assert all(m["iteration"] == it and "valid_lm_loss" in m for it, m in heard.calls)


def test_hook_plugtron_train_end():
    assert _lifecycle_calls()[-1] == "end"


def test_hook_plugtron_checkpoint_saved(tmp_path):
    """Fires once per complete checkpoint, after it was renamed into place (sync and async)."""
    import os

    from plugtron.core.training.loop import pretrain

    class Saved:
        def __init__(self):
            self.calls = []

        @hookimpl
        def plugtron_checkpoint_saved(self, iteration, path):
            self.calls.append((iteration, path, os.path.isdir(path)))

    for async_save in (False, True):
        saved = Saved()
        folder = tmp_path / f"async{async_save}"
        pretrain(tiny_config(train_iters=4, save=str(folder), save_interval=2,
                             async_save=async_save),
                 extra_plugins=[saved], world=single_process())
        assert [(i, os.path.basename(p), exists) for i, p, exists in saved.calls] == [
            (2, "iter_0000002", True), (4, "iter_0000004", True)]
