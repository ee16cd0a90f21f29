"""Loading a checkpoint into a run built for any layout.

Each rank reads exactly the parts of each global tensor its own shards cover, whatever layout
wrote them (pieces.py). The model loads first, then the optimizer (so an optimizer that keeps
main copies of the parameters can refresh them from the loaded model), then the scheduler,
iteration, consumed samples (the data position) and RNG state.

RNG: under the same layout (world size, tp, pp, vp, cp, ep, etp) every rank gets back its own
saved state, and a resumed run is bitwise identical to an uninterrupted one. Under another
layout the saved states have no one-to-one owner, so every rank is reseeded with
``resume_seed(seed, iteration)`` (core/parallel/random.py): deterministic, but dropout masks after the
resume differ from the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from plugtron.core.checkpoint import base, jsonio, state
from plugtron.core.checkpoint.pieces import ShardSpec
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.contracts.model_info import ModelInfo, model_info_of
from plugtron.core.errors import CheckpointError
from plugtron.core.parallel import random as random_module
from plugtron.core.parallel.random import resume_seed, seed_everything, set_rng_state
from plugtron.core.parallel.sharding import added_by_transform, copy_full_into_, is_dtensor
from plugtron.core.plugins import registry
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.plugins.selection import selected_driver


@contextlib.contextmanager
def malformed(reader, field: str, file: str | None = None):
    """A checkpoint value that its consumer (scheduler, optimizer, RNG) cannot take is the
    checkpoint's fault: a ``CheckpointError`` naming the file and the field, not a traceback."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError,
            OverflowError) as exc:
        raise CheckpointError(f"{file or reader.metadata_path}: field {field} is malformed "
                              f"({type(exc).__name__}: {exc})") from None


def check_compatible(saved_config: dict, run) -> None:
    """``CheckpointError`` listing every architecture setting that differs. The model plugin
    says which settings those are (``model_info(config).architecture``)."""
    config = run.config
    saved_model = saved_config.get("plugins", {}).get("model")
    if saved_model and saved_model != selected_driver(config, "model"):
        raise CheckpointError(f"the checkpoint holds a {saved_model!r} model; this run builds "
                              f"--model {selected_driver(config, 'model')!r}")
    check_tokenizer(saved_config, config)

    pm = getattr(run, "pm", None)

    def architecture(cfg) -> dict:
        if pm is not None:
            info = pm.hook.model_info(config=cfg)
        else:  # a run assembled by hand (tools, tests): ask the model plugin directly
            model = registry.instantiate(registry.load("model", selected_driver(config, "model")))
            info = model_info_of(model, cfg)
        return dict(info.architecture) if isinstance(info, ModelInfo) else {}

    saved, now = architecture(config_from_dict(saved_config)), architecture(config)
    diffs = [f"{flag} {saved.get(flag)!r} (this run: {now.get(flag)!r})"
             for flag in sorted(set(saved) | set(now)) if saved.get(flag) != now.get(flag)]
    if diffs:
        raise CheckpointError("the checkpoint's model differs from this run's; run with the "
                              "checkpoint's settings: " + "; ".join(diffs))


def check_tokenizer(saved_config: dict, config) -> None:
    """The run's tokenizer must give the checkpoint's vocabulary: the same ids with another
    tokenizer mean other text, and the model would train on it without a sign."""
    saved_vocab = saved_config.get("model", {}).get("vocab_size")
    vocab = config.model.vocab_size
    if saved_vocab is None or vocab is None or saved_vocab == vocab:
        return
    saved = saved_config.get("data", {})
    was = (f"--tokenizer-type {saved['tokenizer_type']}"
           + (f" --tokenizer-model {saved['tokenizer_model']}"
              if saved.get("tokenizer_model") else "")) if saved.get("tokenizer_type") else None
    raise CheckpointError(
        f"the checkpoint's vocabulary has {saved_vocab} tokens but this run's tokenizer "
        f"({config.data.tokenizer_type or '--vocab-size'}) gives {vocab}; "
        + (f"it was trained with {was}" if was else
           "give the tokenizer the checkpoint was trained with (--tokenizer-type, "
           "--tokenizer-model)"))


def _check_shape(logical: str, saved: tuple, current: tuple, saved_vocab: int | None,
                 current_vocab: int | None, vocab_size: int | None) -> None:
    """Shapes must match, except a vocabulary dimension padded for another tp size."""
    ok = len(saved) == len(current)
    for s, c in zip(saved, current):
        if s != c and not (vocab_size and {s, c} == {saved_vocab, current_vocab}
                           and min(s, c) >= vocab_size):
            ok = False
    if not ok:
        raise CheckpointError(f"tensor {logical!r} has global shape {saved} in the checkpoint "
                              f"but {current} in this run")


def load_checkpoint(run, path: str, model_only: bool = False,
                    tensors: Callable[[torch.Tensor], bool] | None = None) -> CheckpointReader:
    """Load ``path`` (a checkpoint, or a directory of them: the newest complete one) into
    ``run``. Collective when the optimizer gathers its state. ``model_only``: weights only
    (evaluation, fine-tuning from converted weights). ``tensors``: which of the model's
    tensors to read (default: all). A fine-tune's checkpoint that leaves its base out loads
    the base first (:func:`base_for`)."""
    reader = CheckpointReader(path)
    with malformed(reader, "config"):
        check_compatible(reader.config, run)
    if reader.metadata.get(base.BASE_KEY):
        base_for(run, reader, model_only)
        tensors = _and_not_base(tensors)
    saved_vocab = (reader.config.get("model") or {}).get("padded_vocab_size")
    current_vocab = run.config.model.padded_vocab_size
    vocab = run.config.model.vocab_size

    def target_spec(logical: str, spec: ShardSpec) -> None:
        _check_shape(logical, reader.record(logical).global_shape, spec.global_shape,
                     saved_vocab, current_vocab, vocab)

    specs = {}
    for name, tensor, spec in state.model_tensors(run):
        if tensors is not None and not tensors(tensor):
            continue
        stored = state.stored_name(run, name, tensor)
        specs[name] = (stored, spec, tensor)
        logical = f"model/{stored}"
        target_spec(logical, spec)
        if is_dtensor(tensor):  # sharded over data parallelism: read whole, keep our shard
            whole = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
            reader.read_into(logical, whole, spec)
            copy_full_into_(tensor, whole)
        else:
            reader.read_into(logical, tensor, spec)

    contents = reader.metadata.get("contents", {})
    if not model_only and contents.get("optimizer"):
        _load_optimizer(run, reader, specs, target_spec)
    if not model_only:
        run.state.iteration = reader.iteration
        run.state.consumed_samples = reader.metadata.get("consumed_samples") or 0
        if reader.metadata.get("scheduler"):
            with malformed(reader, "scheduler"):
                run.scheduler.load_state_dict(reader.metadata["scheduler"])
        with malformed(reader, "rng", reader.manifest_path(run.world.rank)):
            _restore_rng(run, reader, contents.get("rng", False))
    if run.world.rank == 0:
        print(f"loaded checkpoint {reader.path} (iteration {reader.iteration}, saved with "
              f"{describe_layout(reader.metadata.get('layout', {}))})"
              f"{' weights only' if model_only else ''}", flush=True)
    reader.close()
    return reader


def _and_not_base(tensors: Callable[[torch.Tensor], bool] | None
                  ) -> Callable[[torch.Tensor], bool]:
    return lambda t: not base.is_base_tensor(t) and (tensors is None or tensors(t))


def describe_layout(saved: dict) -> str:
    """``tp 2 pp 2 vp 2 cp 1 dp 2``: the sizes a checkpoint was saved with; vp only when it was
    interleaved (no ``vp None``)."""
    sizes = [("tp", saved.get("tp")), ("pp", saved.get("pp")), ("vp", saved.get("vp")),
             ("cp", saved.get("cp")), ("dp", saved.get("dp"))]
    return " ".join(f"{name} {value}" for name, value in sizes
                    if value is not None or name != "vp")


def _load_optimizer(run, reader, specs, target_spec) -> None:
    current = dict(run.optimizer.sharded_state_dict())  # every rank (may gather)
    current.pop(state.OPTIMIZER_GLOBAL_KEY, None)
    loaded = {}
    for name in current:
        if name not in specs:
            raise CheckpointError(f"the optimizer holds {name!r}, which is not a model tensor")
        stored, spec, param = specs[name]
        entries = {}
        for key in reader.names(f"optim/{stored}/"):
            logical = f"optim/{stored}/{key}"
            target_spec(logical, spec)
            rec = reader.record(logical)
            # Every element is overwritten unless the vocabulary padding differs (then the
            # extra padding rows start at zero, as fresh optimizer state does).
            make = torch.empty if rec.global_shape == spec.global_shape else torch.zeros
            value = make(spec.local_shape, dtype=getattr(torch, rec.dtype))
            reader.read_into(logical, value, spec)
            entries[key] = value.to(param.device)
        loaded[name] = entries
    loaded[state.OPTIMIZER_GLOBAL_KEY] = jsonio.decode(reader.metadata.get("optimizer") or {},
                                                       f"{reader.metadata_path}: field optimizer")
    with malformed(reader, "optimizer"):
        run.optimizer.load_sharded_state_dict(loaded)


def _restore_rng(run, reader, has_rng: bool) -> None:
    if not has_rng:
        return
    tracker = state.rng_tracker(run)
    source = state.rng_source_rank(reader.metadata.get("layout", {}), reader.manifests, run)
    rng = reader.rng_state(source) if source is not None else None
    if rng is not None:
        set_rng_state(rng, tracker)
        return
    seed = resume_seed(run.config.training.seed, reader.iteration)
    seed_everything(seed, run.parallel)
    make_tracker = getattr(random_module, "model_parallel_rng_tracker", None)
    if tracker is not None and make_tracker is not None:
        # The tracker's streams restart from the new seed with Megatron's per-rank offsets.
        tracker.set_state(make_tracker(seed, run.parallel).get_state())
    if run.world.rank == 0:
        print("note: the checkpoint was saved under another layout; per-rank RNG states do "
              "not map onto this one, so every rank was reseeded deterministically from "
              "(seed, iteration)", flush=True)


def load_base(run, path: str, expected: dict | None = None) -> None:
    """Load the base checkpoint ``path`` into ``run``'s model (weights only; the tensors
    transforms added keep their initial values) and remember its identity for the run's
    saves. ``expected``: the identity a fine-tune's checkpoint recorded; another base is a
    ``CheckpointError`` naming both."""
    reader = CheckpointReader(path)
    try:
        found = base.identity(reader)
        if reader.metadata.get(base.BASE_KEY):
            raise CheckpointError(f"--pretrained-checkpoint {path}: {reader.path} holds only what "
                                  f"a fine-tune trained, not a whole model; give the whole "
                                  f"model it was fine-tuned from")
    finally:
        reader.close()
    if expected is not None and expected.get("fingerprint") != found["fingerprint"]:
        raise CheckpointError(f"--pretrained-checkpoint {path} ({found['path']}, iteration "
                              f"{found['iteration']}) is not the base this fine-tune was "
                              f"trained from: {expected.get('path')} (iteration "
                              f"{expected.get('iteration')}); their metadata differ")
    load_checkpoint(run, found["path"], model_only=True,
                    tensors=lambda tensor: added_by_transform(tensor) is None)
    # An optimizer that keeps fp32 main copies (bf16/fp16) takes them from the loaded weights.
    reload = getattr(getattr(run, "optimizer", None), "reload_model_params", None)
    if reload is not None:
        reload()
    run.base_checkpoint = found


def base_for(run, reader: CheckpointReader, model_only: bool) -> None:
    """Before loading ``reader`` (a fine-tune's checkpoint without its base): load the base
    it names, from ``--pretrained-checkpoint`` (a run; required), or for a weights-only load
    (``load_model``, evaluation) from the recorded path when the run names none."""
    expected = reader.metadata[base.BASE_KEY]
    given = run.config.checkpoint.pretrained_checkpoint
    if not given:
        recorded = expected.get("path")
        if not model_only or not recorded or not os.path.exists(recorded):
            raise CheckpointError(f"{reader.path} holds what a fine-tune trained, without its "
                                  f"base model: give --pretrained-checkpoint {recorded} (the "
                                  f"base it names, iteration {expected.get('iteration')})")
        given = recorded
    load_base(run, given, expected)
