"""Tensor and sequence parallelism on 4 gloo processes (one pool for the module).

* each autograd collective's forward and backward on known inputs;
* vocab-parallel cross entropy against torch on the gathered logits (label smoothing, padded
  vocabulary, shards that are all padding) and its gradient; the same for the output layer and
  cross entropy in chunks of tokens (``--cross-entropy-loss-fusion``), with and without SP;
* the local backend's linear layers, and its output layer with a bias, against a plain linear;
* the model-parallel random stream: different across tp ranks, the default one shared;
* training: tp {1, 2, 4} x SP x GQA/MHA x tied/untied, 10 iterations against the single-process
  tp 1 run with the same global batch (the remaining factor of the world is dp): losses within
  relative 1e-5, gathered parameters within 1e-5, replicated parameters bitwise equal over tp.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from plugtron.core.blocks.init import normal_init
from plugtron.core.parallel import comm
from plugtron.core.parallel import tensor_parallel as tpc
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.random import model_parallel_rng_tracker
from plugtron.core.parallel.sharding import full_named_tensors, is_tensor_parallel, shard_of
from plugtron.core.parallel.vocab_parallel import (
    parallel_linear_cross_entropy,
    vocab_parallel_cross_entropy,
    vocab_range,
)

from tests.distributed.harness import worker_cache
from tests.utils import tiny_config, train_in_process

WORLD = 4
ITERS = 10
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(WORLD, timeout=240)


def _ctx(rank, world_size, tp) -> ParallelContext:
    cache = worker_cache()
    if ("tp", tp) not in cache:
        cache[("tp", tp)] = ParallelContext.build(world_size, rank, tp=tp)
    return cache[("tp", tp)]


# --------------------------------------------------------------------------- collectives


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _collectives(rank, world_size):
    """(got, expected) pairs, group of all 4 ranks; rank r's inputs are chosen so every
    expected value is known in closed form."""
    g, r, n = _ctx(rank, world_size, 4).tp_group, rank, world_size
    ar = torch.arange(48.0).reshape(2, 8, 3)
    sl = slice(2 * r, 2 * r + 2)
    block_ids = torch.arange(8).div(2, rounding_mode="floor").float()  # chunk index per position
    out = {}

    x = _leaf(torch.arange(6.0).reshape(2, 3))
    y = tpc.copy_to_tensor_parallel_region(x, g)
    y.backward(torch.full_like(y, r + 1.0))
    out["copy fwd"] = (y, x)
    out["copy bwd all-reduces"] = (x.grad, torch.full((2, 3), 10.0))

    x = _leaf(torch.arange(6.0).reshape(2, 3) * (r + 1))
    y = tpc.reduce_from_tensor_parallel_region(x, g)
    y.backward(torch.full_like(y, r + 1.0))
    out["reduce fwd all-reduces"] = (y, torch.arange(6.0).reshape(2, 3) * 10)
    out["reduce bwd identity"] = (x.grad, torch.full((2, 3), r + 1.0))

    x = _leaf(torch.arange(16.0).reshape(2, 8))
    y = tpc.scatter_to_tensor_parallel_region(x, g)
    y.backward(torch.full_like(y, float(r)))
    out["scatter fwd own chunk"] = (y, torch.arange(16.0).reshape(2, 8)[:, sl])
    out["scatter bwd all-gathers"] = (x.grad, block_ids.expand(2, 8))

    x = _leaf(torch.full((2, 2), float(r)))
    y = tpc.gather_from_tensor_parallel_region(x, g)
    y.backward(torch.arange(16.0).reshape(2, 8))
    out["gather fwd"] = (y, block_ids.expand(2, 8))
    out["gather bwd own chunk"] = (x.grad, torch.arange(16.0).reshape(2, 8)[:, sl])

    x = _leaf(torch.tensor([[10.0 * r, 10.0 * r + 1]]))  # [gate_r, up_r]
    out["gather chunks=2 restores [gate; up]"] = (
        tpc.gather_from_tensor_parallel_region(x, g, chunks=2),
        torch.tensor([[0.0, 10, 20, 30, 1, 11, 21, 31]]))

    x = _leaf(ar)
    y = tpc.scatter_to_sequence_parallel_region(x, g)
    y.backward(torch.full_like(y, float(r)))
    out["sp scatter fwd"] = (y, ar[:, sl])
    out["sp scatter bwd all-gathers"] = (x.grad, block_ids.view(1, 8, 1).expand(2, 8, 3))

    x = _leaf(torch.full((2, 2, 3), float(r)))
    y = tpc.gather_from_sequence_parallel_region(x, g)
    y.backward(ar * (r + 1))
    out["sp gather fwd"] = (y, block_ids.view(1, 8, 1).expand(2, 8, 3))
    out["sp gather bwd reduce-scatters"] = (x.grad, ar[:, sl] * 10)

    x = _leaf(torch.full((2, 2, 3), float(r)))
    y = tpc.gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=False)
    y.backward(ar)
    out["sp gather (replicated consumer) bwd own chunk"] = (x.grad, ar[:, sl])

    x = _leaf(ar * (r + 1))
    y = tpc.reduce_scatter_to_sequence_parallel_region(x, g)
    y.backward(torch.full_like(y, float(r)))
    out["sp reduce-scatter fwd"] = (y, ar[:, sl] * 10)
    out["sp reduce-scatter bwd all-gathers"] = (x.grad, block_ids.view(1, 8, 1).expand(2, 8, 3))

    x = _leaf(torch.arange(16.0).reshape(8, 2))  # sequence-first layout: seq_dim=0
    y = tpc.scatter_to_sequence_parallel_region(x, g, seq_dim=0)
    out["sp scatter seq_dim=0"] = (y, torch.arange(16.0).reshape(8, 2)[sl])

    # A residual add hands the same gradient tensor to both branches: the all-reduce in
    # copy_to's backward must not leak into the other branch.
    x1, x2 = _leaf(torch.zeros(3)), _leaf(torch.zeros(3))
    (tpc.copy_to_tensor_parallel_region(x1, g) + x2).backward(torch.full((3,), r + 1.0))
    out["residual branch keeps its own gradient"] = (x2.grad, torch.full((3,), r + 1.0))
    out["residual tp branch all-reduced"] = (x1.grad, torch.full((3,), 10.0))
    assert n == 4
    return {k: (got.detach(), want) for k, (got, want) in out.items()}


def test_collectives_forward_and_backward(pool):
    for rank, checks in enumerate(pool.run(_collectives)):
        for name, (got, want) in checks.items():
            assert torch.equal(got, want), f"rank {rank}: {name}: {got} != {want}"


def _sp_linear(rank, world_size, dtype=torch.float32, emulated=False):
    """The fused SP linear (keeps only the sequence shard) against gather + F.linear; errors
    relative to the largest reference value. In bf16 on a CPU that emulates it (``emulated``
    pins the CPU's features to AVX2 alone) the fused backward takes its own operand layouts
    (core/blocks/linear.py); elsewhere plain matmuls."""
    from plugtron.core.blocks import cpu_features

    probe = cpu_features._features
    if emulated:
        cpu_features._features = lambda: frozenset({"avx2"})
    try:
        return _sp_linear_errors(rank, world_size, dtype)
    finally:
        cpu_features._features = probe


def _sp_linear_errors(rank, world_size, dtype):
    g = _ctx(rank, world_size, 4).tp_group
    gen = torch.Generator().manual_seed(rank)
    x, w, b = torch.randn(2, 3, 8, generator=gen), torch.randn(5, 8), torch.randn(5)
    grad = torch.randn(2, 12, 5, generator=gen).to(dtype)
    x, w, b = (t.to(dtype) for t in (x, w, b))
    fused = [_leaf(t) for t in (x, w, b)]
    plain = [_leaf(t) for t in (x, w, b)]
    tpc.sequence_parallel_linear(*fused, g).backward(grad)
    F.linear(tpc.gather_from_sequence_parallel_region(plain[0], g), *plain[1:]).backward(grad)
    out = tpc.sequence_parallel_linear(x, w, b, g)
    ref = F.linear(tpc.gather_from_sequence_parallel_region(x, g), w, b)
    pairs = [(out, ref)] + [(f.grad, p.grad) for f, p in zip(fused, plain)]
    return [((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
            for a, r in pairs]


@pytest.mark.parametrize("dtype, tolerance, emulated", [
    (torch.float32, 1e-6, False), (torch.bfloat16, 1e-2, True), (torch.bfloat16, 1e-2, False)])
def test_sequence_parallel_linear_matches_gather_then_linear(pool, dtype, tolerance, emulated):
    for errors in pool.run(_sp_linear, dtype=dtype, emulated=emulated):
        assert max(errors) < tolerance, errors


def test_collectives_are_identity_without_a_group():
    x = torch.randn(2, 4, 3, requires_grad=True)
    for fn in (tpc.copy_to_tensor_parallel_region, tpc.reduce_from_tensor_parallel_region,
               tpc.scatter_to_tensor_parallel_region, tpc.gather_from_tensor_parallel_region,
               tpc.scatter_to_sequence_parallel_region, tpc.gather_from_sequence_parallel_region,
               tpc.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x


# --------------------------------------------------------------------------- cross entropy


def _cross_entropy(rank, world_size, tp, vocab, smoothing, dtype):
    ctx = _ctx(rank, world_size, tp)
    padded = 32
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(2, 5, padded, generator=gen) * 3
    full[..., vocab:] = 30.0  # padding that would win everything if it counted
    labels = torch.randint(0, vocab, (2, 5), generator=gen)
    labels[0, :min(vocab, 5)] = torch.arange(min(vocab, 5)) * (vocab // 5)  # ids in many shards
    weights = torch.rand(2, 5, generator=gen)

    ref_in = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[..., :vocab].reshape(-1, vocab), labels.reshape(-1),
                          reduction="none", label_smoothing=smoothing).view(2, 5)
    (ref * weights).sum().backward()

    start, end = vocab_range(padded, ctx.tp_rank, tp)
    shard = full[..., start:end].to(dtype).requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, ctx.tp_group, vocab, smoothing)
    (loss * weights).sum().backward()
    return ((loss - ref).abs().max().item(),
            (shard.grad.float() - ref_in.grad[..., start:end]).abs().max().item(),
            shard.grad.dtype == dtype, loss.dtype)


@pytest.mark.parametrize("tp,vocab,smoothing", [
    (4, 27, 0.0), (4, 27, 0.1), (2, 27, 0.2),
    (4, 10, 0.1),  # tp ranks 2 and 3 hold only padding
])
def test_vocab_parallel_cross_entropy_matches_torch(pool, tp, vocab, smoothing):
    for loss_err, grad_err, same_dtype, loss_dtype in pool.run(_cross_entropy, tp, vocab,
                                                               smoothing, torch.float32):
        assert loss_err < 1e-5 and grad_err < 1e-6, (loss_err, grad_err)
        assert same_dtype and loss_dtype == torch.float32


def test_vocab_parallel_cross_entropy_single_rank_and_bf16():
    """World of one (group None): the whole padded vocabulary on one rank; bf16 logits get a
    bf16 gradient (the loss is computed in fp32)."""
    for dtype, loss_tol, grad_tol in ((torch.float32, 1e-5, 1e-6), (torch.bfloat16, 0.1, 0.02)):
        loss_err, grad_err, same_dtype, loss_dtype = _cross_entropy(0, 1, 1, 27, 0.1, dtype)
        assert loss_err < loss_tol and grad_err < grad_tol, (dtype, loss_err, grad_err)
        assert same_dtype and loss_dtype == torch.float32


def _linear_cross_entropy(rank, world_size, tp, vocab, smoothing, sp):
    ctx = _ctx(rank, world_size, tp)
    padded, hidden_size, seq = 32, 8, 8
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, seq, hidden_size, generator=gen)
    weight = torch.randn(padded, hidden_size, generator=gen)
    weight[vocab:] = 5.0  # padding rows that would win everything if they counted
    labels = torch.randint(0, vocab, (2, seq), generator=gen)
    labels[0, :min(vocab, seq)] = torch.arange(min(vocab, seq)) * (vocab // seq or 1)
    weights = torch.rand(2, seq, generator=gen)

    ref_hidden, ref_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((ref_hidden @ ref_weight.t())[..., :vocab].reshape(-1, vocab),
                          labels.reshape(-1), reduction="none",
                          label_smoothing=smoothing).view(2, seq)
    (ref * weights).sum().backward()

    start, end = vocab_range(padded, ctx.tp_rank, tp)
    rows = slice(ctx.tp_rank * seq // tp, (ctx.tp_rank + 1) * seq // tp)
    mine = (hidden[:, rows] if sp else hidden).clone().requires_grad_()
    shard = weight[start:end].clone().requires_grad_()
    loss = parallel_linear_cross_entropy(mine, shard, labels, ctx.tp_group, sp, vocab,
                                         smoothing)
    (loss * weights).sum().backward()
    want_hidden = ref_hidden.grad[:, rows] if sp else ref_hidden.grad
    return ((loss - ref).abs().max().item(), (mine.grad - want_hidden).abs().max().item(),
            (shard.grad - ref_weight.grad[start:end]).abs().max().item())


@pytest.mark.parametrize("tp,vocab,smoothing,sp", [
    (4, 27, 0.0, False), (4, 27, 0.1, True), (2, 27, 0.2, True),
    (4, 10, 0.1, False),  # tp ranks 2 and 3 hold only padding
])
def test_linear_cross_entropy_matches_torch_on_whole_logits(pool, tp, vocab, smoothing, sp):
    """The output layer and its loss in chunks, over vocabulary shards: the loss, the hidden
    states' gradient (summed over tp, reduce-scattered under SP) and each shard's weight
    gradient as torch computes them from the whole logits."""
    for loss_err, hidden_err, weight_err in pool.run(_linear_cross_entropy, tp, vocab,
                                                     smoothing, sp):
        assert loss_err < 1e-5 and hidden_err < 1e-5 and weight_err < 1e-5, (
            loss_err, hidden_err, weight_err)


# --------------------------------------------------------------------------- layers


def _linear_layers(rank, world_size):
    from plugtron.plugins.layer_backends.local import LocalBackend

    ctx = _ctx(rank, world_size, 4)
    backend = LocalBackend(tiny_config(tp=4), ctx)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 16, generator=gen)
    out = {}

    init = normal_init(0.5, 1, "column")
    w, b = init((24, 16)), torch.randn(24, generator=gen)
    col = backend.column_parallel_linear(16, 24, bias=True, init_method=init, gather_output=True,
                                         partition_chunks=2)
    with torch.no_grad():
        col.bias.copy_(shard_of(b, 0, ctx.tp_rank, 4, chunks=2))
    xin, ref_in = _leaf(x), _leaf(x)
    y, _ = col(xin)
    ref = F.linear(ref_in, w, b)
    grad = torch.randn(ref.shape, generator=gen)
    y.backward(grad)
    ref.backward(grad)
    out["column gather_output chunks=2"] = (y - ref).abs().max().item()
    out["column input grad"] = (xin.grad - ref_in.grad).abs().max().item()

    init = normal_init(0.5, 1, "row")
    w = init((16, 24))
    row = backend.row_parallel_linear(24, 16, bias=True, init_method=init,
                                      input_is_parallel=False, skip_bias_add=True)
    x24 = torch.randn(2, 4, 24, generator=gen)
    xin, ref_in = _leaf(x24), _leaf(x24)
    y, bias = row(xin)
    ref = F.linear(ref_in, w)
    y.backward(torch.ones_like(y))
    ref.backward(torch.ones_like(ref))
    out["row input not parallel"] = (y - ref).abs().max().item()
    out["row input grad"] = (xin.grad - ref_in.grad).abs().max().item()
    out["row skip_bias_add returns the full bias"] = float(bias.shape != (16,))

    # An output layer with a bias (GPT-J's lm_head): vocab-sharded weight rows and bias.
    w, b = torch.randn(32, 16, generator=gen), torch.randn(32, generator=gen)
    w_shard = _leaf(shard_of(w, 0, ctx.tp_rank, 4))
    b_shard = _leaf(shard_of(b, 0, ctx.tp_rank, 4))
    xin, ref_in, w_ref, b_ref = _leaf(x), _leaf(x), _leaf(w), _leaf(b)
    logits = backend.output_logits(xin, w_shard, parallel_output=False, bias=b_shard)
    ref = F.linear(ref_in, w_ref, b_ref)
    grad = torch.randn(ref.shape, generator=gen)
    logits.backward(grad)
    ref.backward(grad)
    out["output logits with bias"] = (logits - ref).abs().max().item()
    out["output bias grad (this rank's shard)"] = \
        (b_shard.grad - shard_of(b_ref.grad, 0, ctx.tp_rank, 4)).abs().max().item()
    out["output input grad"] = (xin.grad - ref_in.grad).abs().max().item()
    return out


def test_local_linear_layers_match_a_plain_linear(pool):
    for rank, errors in enumerate(pool.run(_linear_layers)):
        for name, err in errors.items():
            assert err < 1e-5, f"rank {rank}: {name}: {err}"


# --------------------------------------------------------------------------- random streams


def _streams(rank, world_size):
    ctx = _ctx(rank, world_size, 2)  # tp pairs [0,1], [2,3]
    tracker = model_parallel_rng_tracker(1234, ctx)
    torch.manual_seed(5)
    plain = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork():
        forked = torch.rand(3)
    after_fork = torch.rand(3)
    state = tracker.get_state()
    with tracker.fork():
        first = torch.rand(2)
    tracker.set_state(state)
    with tracker.fork():
        again = torch.rand(2)
    return plain, forked, after_fork, torch.equal(first, again)


def test_model_parallel_stream_differs_across_tp_only(pool):
    results = pool.run(_streams)
    for plain, _, after_fork, replay in results:
        assert torch.equal(plain, results[0][0]) and torch.equal(after_fork, plain)
        assert replay
    forked = [r[1] for r in results]
    assert not torch.equal(forked[0], forked[1])  # tp ranks 0 and 1 of one group
    assert torch.equal(forked[0], forked[2])  # tp rank 0 of both groups (same dp seed)


# --------------------------------------------------------------------------- training matrix

VARIANTS = {
    "gqa": {"num_attention_heads": 8, "num_query_groups": 4, "swiglu": True,
            "ffn_hidden_size": 64, "position_embedding_type": "rope",
            "normalization": "RMSNorm", "add_bias_linear": False},
    "mha": {"num_attention_heads": 4, "normalization": "LayerNorm", "add_bias_linear": True},
}
EMBEDDINGS = {"tied": {}, "untied": {"untie_embeddings_and_output_weights": True}}
EXTRA = {"smooth": {"label_smoothing": 0.1}}


def _overrides(variant, embedding, extra=None, **more):
    return {"train_iters": ITERS, **VARIANTS[variant], **EMBEDDINGS[embedding],
            **(EXTRA[extra] if extra else {}), **more}


REFERENCE_KEYS = [(v, e, None) for v in VARIANTS for e in EMBEDDINGS] + [("gqa", "tied", "smooth")]


def _references(rank, world_size):
    """The single-process tp 1 runs, spread over the ranks."""
    from plugtron.core.parallel.distributed import single_process

    out = {}
    for key in REFERENCE_KEYS[rank::world_size]:
        records, run = train_in_process(tiny_config(**_overrides(*key)), world=single_process())
        out[key] = ([r["lm_loss"] for r in records],
                    full_named_tensors(run.model_chunks[0].module, None))
    return out


@pytest.fixture(scope="module")
def references(pool):
    merged = {}
    for part in pool.run(_references):
        merged.update(part)
    return merged


def _train(rank, world_size, overrides):
    records, run = train_in_process(tiny_config(**overrides))
    module, tp_group = run.model_chunks[0].module, run.parallel.tp_group
    full = full_named_tensors(module, tp_group)
    # Replicated parameters must stay bitwise identical on every tp rank.
    replicated_diff = 0.0
    for p in module.parameters():
        if not is_tensor_parallel(p):
            peers = comm.all_gather_tensor(p.detach().reshape(1, -1), tp_group)
            replicated_diff = max(replicated_diff, (peers - peers[0]).abs().max().item())
    return ([r["lm_loss"] for r in records], full if rank == 0 else None, replicated_diff)


def _compare(results, reference, vocab_size):
    ref_losses, ref_params = reference
    for losses, _, replicated_diff in results:
        assert len(losses) == ITERS
        for it, (got, want) in enumerate(zip(losses, ref_losses), 1):
            assert abs(got - want) <= LOSS_RTOL * abs(want), f"iteration {it}: {got} vs {want}"
        assert replicated_diff == 0.0
    params = results[0][1]
    assert params.keys() == ref_params.keys()
    for name, want in ref_params.items():
        got = params[name]
        if "word_embeddings" in name or "output_layer" in name:
            # The padded vocabulary grows with tp; padded rows are never used.
            got, want = got[:vocab_size], want[:vocab_size]
        assert got.shape == want.shape, name
        err = (got - want).abs().max().item()
        assert err <= PARAM_ATOL, f"{name}: max abs difference {err}"


MATRIX = list(itertools.product((1, 2, 4), (False, True), VARIANTS, EMBEDDINGS))


@pytest.mark.parametrize("tp,sp,variant,embedding", MATRIX,
                         ids=[f"tp{t}-{'sp' if s else 'nosp'}-{v}-{e}" for t, s, v, e in MATRIX])
def test_training_matches_single_process(pool, references, tp, sp, variant, embedding):
    overrides = _overrides(variant, embedding, tp=tp, sequence_parallel=sp)
    results = pool.run(_train, overrides)
    _compare(results, references[(variant, embedding, None)], tiny_config().model.vocab_size)


def test_gathered_logits_and_label_smoothing(pool, references):
    """--no-parallel-output (logits gathered, torch's loss) with label smoothing at tp 2 + SP
    equals the tp 1 run of the vocab-parallel loss."""
    overrides = _overrides("gqa", "tied", "smooth", tp=2, sequence_parallel=True,
                           parallel_output=False)
    _compare(pool.run(_train, overrides), references[("gqa", "tied", "smooth")],
             tiny_config().model.vocab_size)


@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])
def test_fused_output_loss_training_matches_single_process(pool, references, tp, sp):
    """--cross-entropy-loss-fusion at tp 2 + SP and tp 4: the same training as the unfused
    tp 1 run, within the matrix's tolerances (label smoothing on)."""
    overrides = _overrides("gqa", "tied", "smooth", tp=tp, sequence_parallel=sp,
                           cross_entropy_loss_fusion=True)
    _compare(pool.run(_train, overrides), references[("gqa", "tied", "smooth")],
             tiny_config().model.vocab_size)


def _dropout_losses(rank, world_size):
    overrides = _overrides("mha", "tied", tp=2, sequence_parallel=True, train_iters=3,
                           hidden_dropout=0.2, attention_dropout=0.2)
    return [[r["lm_loss"] for r in train_in_process(tiny_config(**overrides))[0]]
            for _ in range(2)]


def test_dropout_under_tp_is_repeatable(pool):
    """Same seed and layout with dropout in and out of tp regions: bitwise the same losses."""
    for first, second in pool.run(_dropout_losses):
        assert first == second
