"""The check a model transform passes: every layout trains like one process, the merge equals
the transformed model, and a checkpoint round trip resumes it bitwise."""

from __future__ import annotations

import tempfile

import torch
from plugtron.core import checkpoint
from plugtron.core.interchange.converters import plain_model_tensors
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import single_process
from plugtron.core.parallel.sharding import full_tensor
from plugtron.core.training import loop as training
from plugtron.core.training.builder import build_model

from .config import make_config, merge_flags
from .layouts import assert_layouts_match
from .pool import DistributedPool
from .runs import _StepRecorder

#: The layouts a transform that adds or swaps tensor-parallel modules must keep: tp 2 (with and
#: without sequence parallelism), pp 2, dp 2 with the distributed optimizer.
TRANSFORM_LAYOUTS = (
    {"tp": 2},
    {"tp": 2, "sequence-parallel": True},
    {"pp": 2},
    {"dp": 2, "use-distributed-optimizer": True},
)


def _one_process(flags: dict, stop_at: int | None = None):
    """Train ``make_config(flags)`` in this process; (records, run)."""
    config = make_config(flags)
    recorder = _StepRecorder()
    run = training.setup(config, extra_plugins=[recorder], world=single_process())
    if stop_at is not None:
        run.config.training.train_iters = stop_at
    try:
        checkpoint.load_if_requested(run)
        training.train(run, MetricsLogger(config, rank=1))
    finally:
        checkpoint.close(run)
    return recorder.records, run


def _module(run) -> torch.nn.Module:
    (chunk,) = run.model_chunks
    chunk.finish_param_sync()
    return getattr(chunk, "module", chunk)


def assert_merge_matches(run, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """The plain model loaded with what the run's transforms fold back
    (``transform_merged_tensors``) computes the transformed model's logits."""
    module = _module(run).eval()
    tensors = {name: full_tensor(t).detach() for name, t in module.state_dict().items()}
    merged = dict(plain_model_tensors(run.config, tensors))
    parallel = ParallelContext.build(1, 0, device=torch.device("cpu"))
    (plain,) = build_model(run.config, parallel, transforms=False)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert not missing and not unexpected, (
        f"the merge does not give the plain model's tensors: missing {missing}, left over "
        f"{unexpected}")
    vocab = run.config.model.vocab_size
    tokens = torch.randint(0, vocab, (2, run.config.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = module(tokens), plain.eval()(tokens)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                               msg=lambda m: f"merged plain model against the transformed: {m}")


def assert_transform_conforms(flags: dict, layouts=TRANSFORM_LAYOUTS, rtol: float = 1e-5,
                              iters: int = 3, pool: DistributedPool | None = None,
                              merges: bool = True) -> None:
    """For a model transform selected by ``flags`` (``{"model-transforms": "mine", ...}`` or
    its own flag): each layout trains like one process (:func:`assert_layouts_match`); with
    ``merges``, the plain model with the merged tensors computes the transformed model's
    logits after training; and a run saved after ``iters - 1`` iterations and resumed equals
    the uninterrupted one bitwise (losses and every parameter). Tolerance: relative ``rtol``
    (1e-5, fp32) on losses and grad norms per layout and iteration, and on the logits (with
    ``atol`` 1e-5) for the merge. ``pool`` must hold the largest layout's world."""
    base = merge_flags(flags, {"train-iters": iters})
    assert_layouts_match(base, layouts=layouts, rtol=rtol, iters=iters, pool=pool)
    whole, run = _one_process(base)
    if merges:
        assert_merge_matches(run, rtol=rtol)
    with tempfile.TemporaryDirectory(prefix="plugtron-transform-") as directory:
        _one_process(merge_flags(base, {"save": directory}), stop_at=iters - 1)
        resumed, again = _one_process(merge_flags(base, {"save": directory,
                                                         "load": directory}))
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in whole[iters - 1:]], (
        "the resumed run's losses differ from the uninterrupted run's")
    params = dict(_module(run).named_parameters())
    for name, param in _module(again).named_parameters():
        assert torch.equal(param, params[name]), f"{name} differs after the resume"
