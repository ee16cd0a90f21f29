"""``plugtron estimate`` (core/tools/estimate.py): exact parameter counts, activation bytes
equal to what autograd saves, the schedule's in-flight count, and the total within 15% of the
measured peak on CPU for the default model at three layouts (tests/memory_probe.py says what
"measured peak" is)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.api import selected_driver
from plugtron.core.contracts.activations import ActivationShape, module_activation_bytes
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.tools.estimate import estimate_memory
from plugtron.testing import assert_activation_bytes_match, saved_activation_bytes

from tests.fake_plugins import install_fake_distribution, remove_path
from tests.memory_probe import measure_training
from tests.utils import tiny_config

#: README's `make train` model (4 layers, hidden 128, 4 heads, seq 128, micro batch 8, dropout
#: 0.1, fp32) on mock data with the byte tokenizer's vocabulary; 2 microbatches per step.
DEFAULT_RUN = {"data": "mock", "vocab-size": 257, "progress": False, "log-interval": 0,
               "eval-interval": 0, "train-iters": 2, "global-batch-size": 16,
               "num-workers": 0}


# --------------------------------------------------------------------------- formulas


def _tiny_gpt(**flags):
    from plugtron.core.config import padded_vocab_size
    from plugtron.core.parallel.context import ParallelContext
    from plugtron.core.plugins import registry

    config = tiny_config(**flags)
    m = config.model
    m.padded_vocab_size = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    parallel = ParallelContext.build(1, 0, create_groups=False)
    backend = registry.load("layer_backend", "local")(config, parallel)
    model = registry.instantiate(registry.load("model", selected_driver(config, "model"))).model_provider(
        config=config, pre_process=True, post_process=True, vp_stage=None,
        layer_backend=backend, parallel=parallel)
    shape = ActivationShape(config.training.micro_batch_size, m.seq_length, m.seq_length)
    return config, model.train(), shape


def _rotary(model, config, shape):
    """The rotation's frequencies per sample (as with --reset-position-ids), or None."""
    if not model.use_rotary:
        return None
    from plugtron.core.blocks.rotary import rotary_freqs_at

    positions = torch.arange(shape.seq_length).expand(shape.micro_batch_size, -1)
    return rotary_freqs_at(positions, model.head_dim, config.model.rotary_base, None)


def _saved_by_layer(layer, hidden, model, config, shape):
    """What autograd saves in the layer's forward; with --reset-attention-mask two packed
    documents per sample, as the model's forward context would give them."""
    from plugtron.core.blocks.forward_context import forward_context

    documents = None
    if config.samples.reset_attention_mask:
        documents = torch.zeros(shape.micro_batch_size, shape.seq_length, dtype=torch.long)
        documents[:, shape.seq_length // 3:] = 1
    with forward_context(document_ids=documents):
        return saved_activation_bytes(layer, hidden, _rotary(model, config, shape))


@pytest.mark.parametrize("flags", [
    {}, {"hidden_dropout": 0.1, "attention_dropout": 0.1}, {"swiglu": True},
    {"position_embedding_type": "rope", "normalization": "RMSNorm"},
    {"position_embedding_type": "rope", "num_query_groups": 2},
    {"recompute_granularity": "selective", "position_embedding_type": "rope"},
    {"window_size": [7, 0]}, {"reset_attention_mask": True},
    {"recompute_granularity": "selective"},
    {"recompute_granularity": "selective", "recompute_modules": ["mlp,core_attn"],
     "hidden_dropout": 0.1, "attention_dropout": 0.1},
    {"position_embedding_type": "rope", "multi_latent_attention": True, "q_lora_rank": 48,
     "kv_lora_rank": 32, "qk_head_dim": 32, "qk_pos_emb_head_dim": 16, "v_head_dim": 24},
    {"position_embedding_type": "rope", "multi_latent_attention": True, "kv_lora_rank": 32,
     "qk_head_dim": 32, "qk_pos_emb_head_dim": 16, "v_head_dim": 24,
     "recompute_granularity": "selective"},
], ids=["plain", "dropout", "swiglu", "rope-rms", "rope-gqa", "sel-rope", "window",
        "documents", "sel-core", "sel-mlp-dropout", "mla", "mla-sel"])
def test_layer_bytes_are_what_autograd_saves(flags):
    config, model, shape = _tiny_gpt(**flags)
    layer = model.decoder.layers["0"]
    hidden = torch.randn(shape.micro_batch_size, shape.seq_length, config.model.hidden_size,
                         requires_grad=True)
    saved = _saved_by_layer(layer, hidden, model, config, shape)
    said = module_activation_bytes(layer, shape)
    assert said == pytest.approx(saved, rel=0.05), (said, saved)


_HALF_FLAGS = [{}, {"hidden_dropout": 0.1, "attention_dropout": 0.1},
               {"position_embedding_type": "rope", "num_query_groups": 2},
               {"recompute_granularity": "selective", "position_embedding_type": "rope"},
               {"window_size": [7, 0]}, {"reset_attention_mask": True}]


@pytest.mark.parametrize("flags", _HALF_FLAGS,
                         ids=["plain", "dropout", "rope-gqa", "sel-rope", "window", "documents"])
@pytest.mark.parametrize("features, dtype, amx_attention", [
    ({"avx2"}, torch.bfloat16, False),
    ({"avx2", "avx512_bf16", "avx512_fp16", "amx_bf16"}, torch.float16, False),
    ({"avx2", "avx512_bf16", "amx_bf16"}, torch.bfloat16, True),
], ids=["bf16-avx2", "fp16-avx512", "bf16-amx"])
def test_half_precision_layer_bytes_on_each_kind_of_cpu(monkeypatch, flags, features, dtype,
                                                        amx_attention):
    """The CPU's features pinned, so any machine checks all three: without AMX for the dtype
    the attention computes in fp32 and keeps fp32 copies of q, k, v and its output (the rotated
    q and k of the model dtype are then not kept); with AMX-BF16 causal attention takes the
    matmul backward (plugins/layer_backends/cpu_attention.py), which keeps what flash keeps
    (a sliding window's mask as booleans where flash keeps it additive); packed documents run
    each document's flash attention alone (document_attention.py) and keep no mask."""
    from plugtron.core.blocks import cpu_features
    from plugtron.plugins.layer_backends import cpu_attention

    monkeypatch.setattr(cpu_features, "_features", lambda: frozenset(features))
    calls = []
    real = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention",
                        lambda *args: calls.append(1) or real(*args))
    config, model, shape = _tiny_gpt(**flags)
    layer = model.decoder.layers["0"].to(dtype)
    shape = ActivationShape(shape.micro_batch_size, shape.seq_length, shape.context_length,
                            dtype_bytes=2, mask_bytes=2,
                            dtype="bf16" if dtype == torch.bfloat16 else "fp16")
    hidden = torch.randn(shape.micro_batch_size, shape.seq_length, config.model.hidden_size,
                         dtype=dtype, requires_grad=True)
    saved = _saved_by_layer(layer, hidden, model, config, shape)
    said = module_activation_bytes(layer, shape)
    # causal attention without dropout; packed documents run each document's flash alone
    takes_it = not flags.get("attention_dropout") and not flags.get("reset_attention_mask")
    assert bool(calls) == (amx_attention and takes_it)
    assert said == pytest.approx(saved, rel=0.05), (said, saved)


@pytest.mark.parametrize("flags,rel", [
    ({"model": "hybrid", "hybrid_layer_pattern": "M*-"}, 0.1),
    ({"num_experts": 4, "moe_shared_expert_intermediate_size": 64}, 0.3),
    ({"num_experts": 4, "swiglu": True, "moe_router_topk": 1,
      "moe_router_pre_softmax": True}, 0.3),  # top-1 needs pre-softmax (as Megatron)
], ids=["mamba", "moe-shared", "moe-swiglu"])
def test_mamba_and_moe_layer_bytes_near_what_autograd_saves(flags, rel):
    config, model, shape = _tiny_gpt(**flags)
    hidden = torch.randn(shape.micro_batch_size, shape.seq_length, config.model.hidden_size,
                         requires_grad=True)
    for layer in model.decoder.layers.values():
        saved = saved_activation_bytes(layer, hidden, None)
        said = module_activation_bytes(layer, shape)
        assert said == pytest.approx(saved, rel=rel), (type(layer).__name__, said, saved)


def test_whole_chunk_bytes_are_what_autograd_saves():
    config, model, shape = _tiny_gpt(hidden_dropout=0.1, attention_dropout=0.1)
    tokens = torch.randint(0, config.model.vocab_size, (shape.micro_batch_size,
                                                        shape.seq_length))
    assert_activation_bytes_match(model, shape, tokens, labels=tokens, rel=0.05)


def test_whole_chunk_bytes_with_the_fused_output_loss():
    """--cross-entropy-loss-fusion keeps no logits: one log-partition per token and the labels."""
    config, model, shape = _tiny_gpt(cross_entropy_loss_fusion=True)
    tokens = torch.randint(0, config.model.vocab_size, (shape.micro_batch_size,
                                                        shape.seq_length))
    assert_activation_bytes_match(model, shape, tokens, labels=tokens, rel=0.05)


@pytest.mark.parametrize("fused", [False, True], ids=["", "fused-loss"])
def test_whole_chunk_bytes_with_multi_token_prediction(fused):
    """Two MTP depths on the chunk (issue 27): their layers, norms, projections and losses."""
    config, model, shape = _tiny_gpt(position_embedding_type="rope", mtp_num_layers=2,
                                     cross_entropy_loss_fusion=fused)
    tokens = torch.randint(0, config.model.vocab_size, (shape.micro_batch_size,
                                                        shape.seq_length))
    assert_activation_bytes_match(model, shape, tokens, labels=tokens,
                                  loss_mask=torch.ones(tokens.shape), rel=0.05)


def _rows(flags, world_size):
    return estimate_memory(config_from_flags({**DEFAULT_RUN, **flags}, "test"), world_size,
                           cuda=False).ranks


def test_recompute_sp_cp_pp_change_activations_as_they_must():
    base = _rows({}, 1)[0]
    full = _rows({"recompute_granularity": "full"}, 1)[0]
    selective = _rows({"recompute_granularity": "selective"}, 1)[0]
    block = _rows({"recompute_granularity": "full", "recompute_method": "block",
                   "recompute_num_layers": 2}, 1)[0]
    # full recompute keeps one residual tensor per layer and rebuilds one layer at a time
    assert full.activation_bytes < block.activation_bytes < base.activation_bytes
    assert 0 < full.recompute_bytes == block.recompute_bytes
    assert selective.activation_bytes < base.activation_bytes and selective.recompute_bytes == 0
    tp2 = _rows({"tp": 2}, 2)[0]
    sp = _rows({"tp": 2, "sequence_parallel": True}, 2)[0]
    assert sp.activation_bytes < tp2.activation_bytes < base.activation_bytes
    cp2 = _rows({"cp": 2}, 2)[0]
    assert cp2.activation_bytes < base.activation_bytes / 1.9  # tokens and scores halve
    # 1F1B with 4 microbatches: stage 0 holds pp - 0 = 2, stage 1 holds 1
    stages = _rows({"pp": 2, "global_batch_size": 32}, 2)
    assert [r.in_flight for r in stages] == [2, 1]
    assert stages[0].activation_bytes == 2 * stages[0].activations_per_microbatch[0]
    # interleaved, pp 2 x vp 2, 8 microbatches: Megatron's warmup (pp - r - 1) x 2 + (vp - 1)
    # x pp, plus the one being run
    inter = _rows({"pp": 2, "vp": 2, "global_batch_size": 64}, 2)
    assert [r.in_flight for r in inter] == [5, 3]


def test_parameter_counts_and_optimizer_columns():
    rows = _rows({"tp": 2, "use_distributed_optimizer": True}, 4)  # tp 2 x dp 2
    assert len(rows) == 2 and all(len(r.ranks) == 2 for r in rows)
    r = rows[0]
    assert r.optimizer_bytes_distributed * 2 == r.optimizer_bytes
    assert r.optimizer_selected == r.optimizer_bytes_distributed
    bf16 = _rows({"bf16": True}, 1)[0]
    # bf16 weights, fp32 grads (accumulated in fp32), fp32 master + 2 moments
    assert bf16.param_bytes == 2 * bf16.parameters and bf16.grad_bytes == 4 * bf16.parameters
    assert bf16.optimizer_bytes == 12 * bf16.parameters


THIRD_PARTY_OPTIMIZERS = """
    from plugtron.api import TorchOptimizer, hookimpl

    class OneMoment:
        @hookimpl
        def optimizer_state_per_param(self, config):
            return 1

        @hookimpl
        def build_optimizer(self, config, model_chunks, parallel):
            raise NotImplementedError

    class ShardedOneMoment(OneMoment):
        @hookimpl
        def optimizer_shards_gradients(self, config):
            return True

    class Silent:
        @hookimpl
        def build_optimizer(self, config, model_chunks, parallel):
            raise NotImplementedError
"""


@pytest.fixture()
def third_party_optimizers(tmp_path):
    install_fake_distribution(
        tmp_path, "plugtron-optim-estimate", "0.1",
        {"plugtron.optimizers": {"one-moment": "optim_estimate:OneMoment",
                                 "sharded-one-moment": "optim_estimate:ShardedOneMoment",
                                 "silent": "optim_estimate:Silent"}},
        {"optim_estimate": THIRD_PARTY_OPTIMIZERS})
    yield
    remove_path(tmp_path)


def test_a_third_party_optimizer_is_counted_as_it_declares(third_party_optimizers):
    """A one-moment optimizer counts 1 fp32 value per parameter, replicated or (when it shards
    gradients) sharded over dp; one that says nothing is counted as Adam, with a note."""
    one = _rows({"optimizer": "one-moment"}, 2)[0]
    assert one.optimizer_bytes == 4 * one.parameters
    assert one.optimizer_selected == one.optimizer_bytes
    sharded = _rows({"optimizer": "sharded-one-moment"}, 2)[0]
    assert sharded.optimizer_selected == sharded.optimizer_bytes_distributed
    assert sharded.optimizer_bytes_distributed * 2 == sharded.optimizer_bytes
    silent = estimate_memory(tiny_config(optimizer="silent"), 1)
    assert silent.ranks[0].optimizer_bytes == 8 * silent.ranks[0].parameters
    assert any("does not implement optimizer_state_per_param" in n for n in silent.notes)


OLD_FORM_WRAPPER = """
    from plugtron.api import DataParallelMemory, hookimpl

    class OneNumber:
        # data_parallel_memory as written before the optimizer answered per parameter

        @hookimpl
        def data_parallel_memory(self, config, chunks, dp_cp, state_per_param):
            numel = sum(p.numel() for chunk in chunks for p in chunk.parameters())
            return DataParallelMemory(numel * 4, numel * 4, numel * 4 * state_per_param)

        @hookimpl
        def wrap_model_chunk(self, config, module, parallel, shard_gradients):
            raise NotImplementedError
"""


def test_a_wrapper_counting_one_number_gets_the_largest_per_parameter_answer(tmp_path):
    """Muon answers 1 for its matrices and 2 for AdamW's parameters: a wrapper of the old form
    (``state_per_param`` alone) counts 2 for every parameter, a bound; ddp counts each."""
    install_fake_distribution(tmp_path, "plugtron-one-number", "0.1",
                              {"plugtron.data_parallel": {"one-number": "one_number:OneNumber"}},
                              {"one_number": OLD_FORM_WRAPPER})
    try:
        bound = _rows({"optimizer": "muon", "data_parallel": "one-number"}, 1)[0]
    finally:
        remove_path(tmp_path)
    exact = _rows({"optimizer": "muon"}, 1)[0]
    assert bound.optimizer_selected == 8 * bound.parameters
    assert 4 * exact.parameters < exact.optimizer_selected < bound.optimizer_selected


# --------------------------------------------------------------------------- CLI


def test_estimate_command_and_the_refusal(monkeypatch):
    from plugtron.cli.main import cli
    from plugtron.core.tools import estimate as memory_estimate

    runner = CliRunner()
    out = runner.invoke(cli, ["estimate", "--data", "mock", "--vocab-size", "257",
                              "--nproc-per-node", "2", "--tp", "2"])
    assert out.exit_code == 0, out.output
    assert "optim(dist)" in out.output and "activations" in out.output
    monkeypatch.setattr(memory_estimate, "available_memory_per_rank",
                        lambda ranks, cuda=None: 2**10)
    args = ["train", *tiny_flags(), "--train-iters", "1"]
    refused = runner.invoke(cli, args)
    assert refused.exit_code == 2, refused.output
    assert "GiB" in refused.output and "--no-memory-check" in refused.output
    allowed = runner.invoke(cli, [*args, "--no-memory-check"])
    assert allowed.exit_code == 0, allowed.output


def tiny_flags() -> list[str]:
    from tests.utils import TINY

    out = []
    for key, value in TINY.items():
        if value is False:
            out.append(f"--no-{key}")
        else:
            out += [f"--{key}", str(value)]
    return out


# --------------------------------------------------------------------------- measured


def _measure_on_rank(rank, world_size, flags):
    return measure_training(config_from_flags({**DEFAULT_RUN, **flags}, "test"))


@pytest.fixture(scope="module")
def pool():
    from tests.distributed.harness import DistributedPool

    with DistributedPool(2) as p:
        yield p


@pytest.mark.parametrize("flags,world_size", [
    ({}, 1), ({"tp": 2}, 2), ({"use_distributed_optimizer": True}, 2), ({"bf16": True}, 1)],
    ids=["1-rank", "tp2", "dp2-distopt", "bf16-1-rank"])
def test_estimate_within_15_percent_of_measured_peak(pool, flags, world_size):
    for result in pool.run(_measure_on_rank, flags, world_size=world_size):
        print(f"measured {result['measured'] / 2**20:.1f} MiB, estimated "
              f"{result['estimated'] / 2**20:.1f} MiB")
        assert result["estimated_numel"] == result["numel"]
        ratio = result["estimated"] / result["measured"]
        assert 0.85 <= ratio <= 1.15, (ratio, result)


class _Doubler(torch.nn.Module):
    """Saves its input (the square's backward) and the square (the product's, for the weight's
    gradient): 8 bytes per input element; never the weight itself."""

    def __init__(self, says: int | None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        if says is not None:
            self.activation_bytes = lambda shape: says

    def forward(self, x):
        return x.square() * self.weight


def test_the_kits_activation_check_holds_a_layer_to_autograd():
    x = torch.randn(2, 8, 4, requires_grad=True)  # 64 fp32 elements, 256 bytes
    shape = ActivationShape(2, 8, 8)
    assert saved_activation_bytes(_Doubler(None), x) == 512
    assert_activation_bytes_match(_Doubler(500), shape, x)  # within 5%
    with pytest.raises(AssertionError, match="says 100 bytes, autograd saves 512"):
        assert_activation_bytes_match(_Doubler(100), shape, x)
    with pytest.raises(AssertionError, match="defines no activation_bytes"):
        assert_activation_bytes_match(_Doubler(None), shape, x)


def _tensors_held_by(fn, seen: set, depth: int = 0) -> int:
    """Bytes of the (non-parameter) tensors a deferred weight-gradient closure holds, each
    storage once."""
    total = 0
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, torch.nn.Parameter):
            continue
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif callable(value) and depth < 3:
            total += _tensors_held_by(value, seen, depth + 1)
    return total


@pytest.mark.parametrize("flags", [{}, {"swiglu": True, "normalization": "RMSNorm"},
                                   {"cross_entropy_loss_fusion": True}],
                         ids=["plain", "swiglu-rms", "fused-loss"])
def test_what_a_split_backward_keeps_until_w_is_what_the_estimate_says(flags):
    # the estimate counts a microbatch from its I to its W with weight_grad_bytes: what the
    # deferred weight gradients hold (inputs and output gradients), held to the real closures
    from plugtron.core.contracts import weight_grads as wgrad

    config, model, shape = _tiny_gpt(**flags)
    tokens = torch.randint(0, config.model.vocab_size, (shape.micro_batch_size,
                                                        shape.seq_length))
    with wgrad.expecting_split_backward():
        loss = model(tokens, labels=tokens)
    store = wgrad.WeightGradStore()
    with wgrad.collecting_weight_grads(store):
        loss.sum().backward()
    seen: set = set()
    held = sum(_tensors_held_by(compute, seen) for _, compute in store.pending)
    said = model.activation_bytes(shape).until_weights
    assert said == pytest.approx(held, rel=0.1), (said, held)
