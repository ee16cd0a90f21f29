"""Layer backend ``te``: clear errors where transformer-engine or CUDA is missing (checked
everywhere), and a short GPU run against ``local`` (skipped without both)."""

import contextlib
import importlib.util
from unittest import mock

import pytest
import torch
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.plugins import registry

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
    from plugtron.core.parallel.distributed import single_process

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


def test_plugtron_cp_fallback_draws_attention_dropout_from_the_layer_stream():
    """A TE without its own cp runs plugtron's context_parallel_attention; its dropout seed must
    come from the layer's dropout stream (as local.CoreAttention), not the default stream."""
    from plugtron.core.parallel.random import MODEL_PARALLEL_RNG
    from plugtron.plugins.layer_backends import te

    from tests import fake_transformer_engine

    seen = {}

    def attention(q, k, v, parallel, comm_type, p, documents=None):
        seen.update(state=torch.get_rng_state(), comm_type=comm_type, p=p)
        torch.rand(4)  # a draw, as draw_dropout's seed: it must advance the stream only
        return q.flatten(2)

    config = tiny_config(cp=2, seq_length=16, attention_dropout=0.25, cp_comm_type="allgather")
    with fake_transformer_engine.installed():
        backend = te.TEBackend(config, ParallelContext.build(2, 1, cp=2, create_groups=False))
    module = backend.core_attention(4, 2, 8, 0.25).train()
    stream = backend.rng_tracker.get_state()[MODEL_PARALLEL_RNG]
    q = torch.randn(1, 8, 4, 8)
    default = torch.get_rng_state()
    with mock.patch.object(te, "context_parallel_attention", attention):
        module(q, q[:, :, :2], q[:, :, :2])
    assert seen["comm_type"] == "allgather" and seen["p"] == 0.25
    assert torch.equal(seen["state"], stream)  # drew from the layer's stream...
    assert torch.equal(torch.get_rng_state(), default)  # ...and left the default one alone
    assert not torch.equal(backend.rng_tracker.get_state()[MODEL_PARALLEL_RNG], stream)


def _documents_against_local(backend, device, dtype, dim, tolerance):
    from plugtron.api import forward_context
    from plugtron.plugins.layer_backends import local

    te_attention = backend.core_attention(4, 2, dim, 0.0)
    local_attention = local.CoreAttention(4, 2, dim, 0.0, lambda: contextlib.nullcontext())
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 48, 4, dim, generator=gen)
    k, v = torch.randn(2, 48, 2, dim, generator=gen), torch.randn(2, 48, 2, dim, generator=gen)
    grad = torch.randn(2, 48, 4 * dim, generator=gen)
    documents = torch.tensor([[0] * 20 + [1] * 1 + [2] * 27, [0] * 48]).to(device)
    results = []
    for attention in (te_attention, local_attention):
        inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        with forward_context(document_ids=documents):
            out = attention(*inputs)
        out.backward(grad.to(device, dtype))
        results.append((out.detach(), *(t.grad for t in inputs)))
    for got, want, name in zip(*results, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance,
                                   msg=name)


def test_packed_documents_go_to_te_as_thd_and_equal_local():
    """Document numbers reach TE's attention as Megatron passes packed sequences (THD, int32
    cu_seqlens over the batch's rows laid end to end, padding_causal; the stand-in checks each),
    which gives local's per-document attention: output and gradients (fp32, 1e-5)."""
    from plugtron.plugins.layer_backends import te

    from tests import fake_transformer_engine

    with fake_transformer_engine.installed():
        backend = te.TEBackend(tiny_config(), ParallelContext.build(1, 0))
    _documents_against_local(backend, "cpu", torch.float32, 8, 1e-5)


@pytest.mark.skipif(not (HAVE_TE and HAVE_GPU), reason="needs transformer-engine and a CUDA GPU")
def test_packed_documents_on_te_equal_local_on_the_gpu():
    """The same on transformer-engine's own THD attention (bf16, its fused kernels)."""
    from plugtron.plugins.layer_backends import te

    backend = te.TEBackend(tiny_config(), ParallelContext.build(1, 0))
    _documents_against_local(backend, "cuda", torch.bfloat16, 64, 3e-2)


def test_packed_documents_under_cp_take_plugtron_cp_attention_even_with_te_cp():
    """TE's own THD cp wants another chunk order than plugtron's cp split: with documents the
    batch goes to plugtron's cp attention, with their numbers; without, to TE's own cp."""
    from plugtron.api import forward_context
    from plugtron.plugins.layer_backends import te

    from tests import fake_transformer_engine

    seen = []
    config = tiny_config(cp=2, seq_length=16)
    with fake_transformer_engine.installed():
        backend = te.TEBackend(config, ParallelContext.build(2, 1, cp=2, create_groups=False))
    with mock.patch.object(fake_transformer_engine.DotProductAttention,
                           "set_context_parallel_group", create=True,
                           new=lambda self, *args: seen.append("te cp")), \
            mock.patch("torch.cuda.Stream"):  # TE's cp is given a CUDA stream
        module = backend.core_attention(4, 2, 8, 0.0)
    q = torch.randn(1, 8, 4, 8)
    documents = torch.tensor([[0] * 10 + [1] * 6])
    with mock.patch.object(te, "context_parallel_attention",
                           lambda q, k, v, parallel, comm, p, docs: seen.append(docs) or
                           q.flatten(2)):
        with forward_context(document_ids=documents):
            module(q, q[:, :, :2], q[:, :, :2])
        module(q, q[:, :, :2], q[:, :, :2])  # no documents: TE's own cp (the stand-in's maths)
    assert seen[0] == "te cp" and seen[1] is documents and len(seen) == 2
