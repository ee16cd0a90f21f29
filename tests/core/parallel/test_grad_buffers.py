"""Gradient buffers, buckets and the data-parallel wrapper's hooks on one process."""

import pytest
import torch
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.ddp import DistributedDataParallel
from plugtron.core.parallel.grad_buffer import default_bucket_size, plan_buckets, shard_alignment
from plugtron.core.training.validate import validate

from tests.utils import tiny_config


def _toy():
    # Parameters in model order: 0.w 32, 0.b 8, 1.w 128, 1.b 16, 2.w 32, 2.b 2.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _wrap(module, sharded=False, **overrides):
    config = tiny_config(**overrides)
    return DistributedDataParallel(module, config, ParallelContext.build(1, 0), sharded=sharded)


def test_plan_closes_a_bucket_once_it_reaches_the_size():
    # Reverse model order: 2.b 2, 2.w 32, 1.b 16, 1.w 128, 0.b 8, 0.w 32.
    ranges, buckets = plan_buckets([2, 32, 16, 128, 8, 32], bucket_size=40)
    assert [(b.start, b.end, b.params) for b in buckets] == [
        (0, 50, (0, 1, 2)), (50, 178, (3,)), (178, 218, (4, 5))]
    assert ranges[3] == (50, 178) and ranges[5] == (186, 218)


def test_plan_pads_buckets_for_equal_shards_and_isolates_shared_params():
    alignment = shard_alignment(4)
    assert alignment == 128
    _, buckets = plan_buckets([2, 32, 16, 128, 8, 32], bucket_size=40, alignment=alignment,
                              own_bucket=[False, False, False, False, True, False])
    assert [(b.start, b.end, b.params) for b in buckets] == [
        (0, 128, (0, 1, 2)), (128, 256, (3,)), (256, 384, (4,)), (384, 512, (5,))]
    assert all((b.end - b.start) % 4 == 0 for b in buckets)


def test_plan_rejects_a_bucket_size_below_one():
    with pytest.raises(ValueError, match="at least 1"):
        plan_buckets([3], bucket_size=0)


def test_wrapper_packs_parameters_in_reverse_order_into_views_of_one_buffer():
    module = _toy()
    ddp = _wrap(module, ddp_bucket_size=40)
    (buffer,) = ddp.grad_buffers
    names = {id(p): n for n, p in module.named_parameters()}
    assert [[names[id(p)] for p in b.params] for b in buffer.buckets] == [
        ["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"]]
    assert [(b.start, b.end) for b in buffer.buckets] == [(0, 50), (50, 178), (178, 218)]
    for p in module.parameters():
        lo, _ = buffer.ranges[id(p)]
        assert p.main_grad.shape == p.shape
        assert p.main_grad.data_ptr() == buffer.grad_data[lo:].data_ptr()


def test_sharded_wrapper_keeps_parameters_in_a_flat_buffer():
    module = _toy()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    ddp = _wrap(module, sharded=True, ddp_bucket_size=40)
    (buffer,) = ddp.grad_buffers
    assert buffer.numel == 3 * 128
    for name, p in module.named_parameters():
        lo, _ = buffer.ranges[id(p)]
        assert torch.equal(p, before[name])
        assert p.data_ptr() == buffer.param_data[lo:].data_ptr()


def test_sharded_wrapper_gives_a_shared_embedding_its_own_bucket():
    # The first and last pipeline stage must shard the tied weight alike (summed afterwards).
    module = _toy()
    module[4].weight.shared_group = "embedding"
    names = {id(p): n for n, p in module.named_parameters()}
    (plain,) = _wrap(module, ddp_bucket_size=1000).grad_buffers
    assert [len(b.params) for b in plain.buckets] == [6]
    (buffer,) = _wrap(module, sharded=True, ddp_bucket_size=1000).grad_buffers
    assert [[names[id(p)] for p in b.params] for b in buffer.buckets] == [
        ["4.bias"], ["4.weight"], ["2.bias", "2.weight", "0.bias", "0.weight"]]


def test_default_bucket_size_follows_megatron():
    assert default_bucket_size(1) == 40_000_000 and default_bucket_size(64) == 64_000_000
    (buffer,) = _wrap(_toy()).grad_buffers
    assert len(buffer.buckets) == 1


def test_hook_accumulates_microbatches_into_main_grad_and_frees_grad():
    reference, module = _toy(), _toy()
    ddp = _wrap(module, ddp_bucket_size=40, overlap_grad_reduce=True)
    x = torch.randn(3, 4, 4)
    for i in range(3):
        reference(x[i]).square().sum().backward()
        context = ddp.no_sync() if i < 2 else torch.enable_grad()
        with context:
            ddp(x[i]).square().sum().backward()
    ddp.finish_grad_sync()
    for p, q in zip(reference.parameters(), module.parameters()):
        assert q.grad is None
        torch.testing.assert_close(q.main_grad, p.grad, rtol=1e-6, atol=1e-7)
    ddp.zero_grad_buffer()
    assert all(float(p.main_grad.abs().max()) == 0 for p in module.parameters())


def test_bf16_parameters_accumulate_in_fp32_unless_told_otherwise():
    module = _toy().to(torch.bfloat16)
    (buffer,) = _wrap(module, bf16=True).grad_buffers
    assert buffer.grad_dtype == torch.float32 and buffer.param_dtype == torch.bfloat16
    module = _toy().to(torch.bfloat16)
    (buffer,) = _wrap(module, bf16=True,
                      accumulate_allreduce_grads_in_fp32=False).grad_buffers
    assert buffer.grad_dtype == torch.bfloat16


def test_expert_parameters_get_their_own_buffer():
    module = _toy()
    module[4].weight.allreduce = False
    ddp = _wrap(module)
    assert [len(b.params) for b in ddp.grad_buffers] == [5, 1]
    assert ddp.grad_buffers[1].params[0] is module[4].weight


def test_a_grad_after_its_bucket_started_is_an_error():
    ddp = _wrap(_toy(), ddp_bucket_size=40, overlap_grad_reduce=True)
    x = torch.randn(2, 4)
    ddp(x).sum().backward()  # last-microbatch semantics: buckets start
    with pytest.raises(RuntimeError, match="no_sync"):
        ddp(x).sum().backward()


@pytest.mark.parametrize("overrides, message", [
    ({"ddp_bucket_size": 0}, "--ddp-bucket-size must be at least 1, got 0"),
    ({"ddp_bucket_size": -5}, "--ddp-bucket-size must be at least 1"),
    ({"fp16": True, "bf16": True}, "--bf16 and --fp16 are exclusive"),
    ({"overlap_param_gather": True}, "--overlap-param-gather needs a sharding optimizer"),
    ({"fp16": True, "hysteresis": 0}, "--hysteresis"),
    ({"fp16": True, "initial_loss_scale": 0}, "--initial-loss-scale"),
])
def test_bad_settings_fail_clearly(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        validate(tiny_config(**overrides), world_size=1)


def test_a_whole_gradient_optimizer_refuses_sharded_buffers():
    from plugtron.core.errors import PluginError
    from plugtron.core.training.optimizer import TorchOptimizer

    ddp = _wrap(_toy(), sharded=True)
    with pytest.raises(PluginError, match="sharded"):
        TorchOptimizer([ddp], ddp.config, ddp.parallel, lambda g: torch.optim.SGD(g, lr=0.1))


class _ReadsChildWeight(torch.nn.Module):
    """Reads ``head.weight`` without calling ``head`` (as a GPT last stage reads its output
    layer's weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        return torch.nn.functional.linear(self.body(x), self.head.weight)


def test_param_gather_waits_up_front_for_params_of_modules_never_called():
    module = _ReadsChildWeight()
    ddp = _wrap(module, sharded=True, ddp_bucket_size=10, overlap_param_gather=True,
                use_distributed_optimizer=True)
    (buffer,) = ddp.grad_buffers
    assert [len(b.params) for b in buffer.buckets] == [2, 2]  # head.*, then body.*
    ddp(torch.randn(2, 4))
    ddp.start_param_sync()  # after the first forward: which buckets no module hook covers
    assert ddp._uncovered_buckets == [buffer.buckets[0]]
