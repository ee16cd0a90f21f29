"""What a run's checkpoint holds, read off the run: which tensors this rank writes and how each
is sharded, and the JSON side (layout, config, plugins, scheduler).

Rules (the contracts in docs/checkpoints.md):

* Model tensors are every chunk's ``state_dict`` entry (parameters and persistent buffers) under
  its global name; sharding is what the layer declared on the tensor (core/parallel/sharding.py).
  A data-parallel wrapper's DTensor shards (``fsdp2``) are gathered into the whole tensor when
  saved and cut again when loaded: the files never depend on the data-parallel layout.
* Data-parallel replicas are identical: only dp-cp rank 0 writes (expert tensors, which differ
  across ep ranks: expert-data-parallel rank 0). Tensor-parallel replicas
  (tensors that are not tp-sharded) are written by tp rank 0 only; expert tensors are split
  over (and replicated across) the expert tensor-parallel group instead, so etp rank 0.
* A parameter shared between stages (``share_parameter``, e.g. a tied output weight) is stored
  once, under its group's name (its name on the first stage); the other copies are never
  written and load from that one.
* The optimizer gives ``sharded_state_dict()``: ``{param name: {key: tensor shaped like the
  param's local shard}}`` plus JSON-able global state under ``"__optimizer__"``.
"""

from __future__ import annotations

import time
from importlib import metadata

import torch
from plugtron.core.checkpoint import base
from plugtron.core.checkpoint.jsonio import encode
from plugtron.core.checkpoint.pieces import ShardSpec, local_boxes_of
from plugtron.core.checkpoint.reader import FORMAT, VERSION
from plugtron.core.checkpoint.writer import RankSnapshot, TensorEntry
from plugtron.core.errors import CheckpointError
from plugtron.core.parallel import shared_params
from plugtron.core.parallel.random import get_rng_state
from plugtron.core.parallel.sharding import full_tensor, is_expert, tp_split_of
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import (
    DRIVER_ROLES,
    chosen_names,
    resolve_optimizer,
    resolve_schedule,
    selected_drivers,
)

OPTIMIZER_GLOBAL_KEY = "__optimizer__"


def model_tensors(run) -> list[tuple[str, torch.Tensor, ShardSpec]]:
    """(global name, local tensor, sharding) of every model tensor on this rank."""
    p = run.parallel
    out = []
    for chunk in run.model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, tensor in module.state_dict(keep_vars=True).items():
            _, rank, size = tp_split_of(tensor, p)  # etp for expert tensors
            out.append((name, tensor, ShardSpec.of_param(tensor, rank, size)))
    return out


def stored_name(run, name: str, tensor: torch.Tensor) -> str:
    """The name a tensor is stored under: a shared copy under its group's name."""
    return shared_params.group_of(tensor) or name


def _standalone(t: torch.Tensor) -> bool:
    """Owns its whole storage (safetensors refuses views and tensors that share storage)."""
    storage = t.untyped_storage()
    return (t.is_contiguous() and t.data_ptr() == storage.data_ptr()
            and t.numel() * t.element_size() == storage.nbytes())


def _staged(staging: dict, key: tuple, part: torch.Tensor) -> torch.Tensor:
    """``part`` copied into this rank's reusable host buffer for ``key``: allocating (and
    page-faulting) fresh host memory at every save costs more than the copy itself."""
    buf = staging.get(key)
    if buf is None or buf.shape != part.shape or buf.dtype != part.dtype:
        buf = torch.empty(part.shape, dtype=part.dtype, pin_memory=part.is_cuda)
        staging[key] = buf
    buf.copy_(part, non_blocking=part.is_cuda)
    return buf


def _entry(logical: str, tensor: torch.Tensor, spec: ShardSpec, copy: bool, seen: set,
           staging: dict | None) -> TensorEntry:
    boxes = []
    for i, (box, part) in enumerate(local_boxes_of(tensor.detach(), spec)):
        if copy or part.device.type != "cpu":
            if staging is None:
                staging = {}
            out = _staged(staging, (logical, i), part)
        elif _standalone(part) and part.untyped_storage().data_ptr() not in seen:
            out = part  # written synchronously: no copy needed
        else:
            out = part.clone(memory_format=torch.contiguous_format)
        seen.add(out.untyped_storage().data_ptr())
        boxes.append((box, out))
    return TensorEntry(logical, spec.global_shape, boxes)


def rng_tracker(run):
    """The run's tensor-parallel RNG tracker (kept by the layer backend), if it has one."""
    return getattr(getattr(run, "backend", None), "rng_tracker", None)


def writes_here(run, spec: ShardSpec, expert: bool = False) -> bool:
    """Whether this rank writes a tensor: its data-parallel rank 0 (for expert tensors the
    expert-data-parallel rank 0: the ep ranks hold different experts), and tp rank 0 unless
    the tensor is tp-sharded."""
    p = run.parallel
    first = p.edp_rank == 0 if expert else p.dp_cp_rank == 0
    return first and (spec.sharded or (p.etp_rank if expert else p.tp_rank) == 0)


_is_expert = is_expert


def snapshot(run, copy: bool, staging: dict | None = None) -> tuple[RankSnapshot, dict]:
    """This rank's tensors on the CPU (copies when ``copy``, for writing in the background, into
    the reusable buffers of ``staging``), its RNG state, and the optimizer's global state. Every
    rank must call it: the optimizer may gather its shards here."""
    seen: set = set()
    model, optim, specs = [], [], {}
    for chunk in run.model_chunks:
        # A data-parallel wrapper that gathers parameters lazily (--overlap-param-gather)
        # finishes the gather first: the checkpoint must see the stepped weights.
        finish = getattr(chunk, "finish_param_sync", None)
        if finish is not None:
            finish()
    without_base = base.saves_without_base(run)
    for name, tensor, spec in model_tensors(run):
        stored = stored_name(run, name, tensor)
        specs[name] = (stored, spec, _is_expert(tensor))
        if without_base and base.is_base_tensor(tensor):
            continue  # the base checkpoint holds it, unchanged
        # A tensor sharded over data parallelism (DTensor) is gathered by every rank of its
        # group (a collective), then written like a whole one by the first.
        whole = full_tensor(tensor)
        if stored == name and writes_here(run, spec, _is_expert(tensor)):
            model.append(_entry(f"model/{name}", whole, spec, copy or whole is not tensor,
                                seen, staging))
    state = dict(run.optimizer.sharded_state_dict())
    global_state = state.pop(OPTIMIZER_GLOBAL_KEY, {})
    for name, entries in state.items():
        if name not in specs:
            raise CheckpointError(f"the optimizer has state for {name!r}, which is not a "
                                  f"tensor of the model")
        stored, spec, expert = specs[name]
        if stored != name or not writes_here(run, spec, expert):
            continue
        for key, value in entries.items():
            if not torch.is_tensor(value) or tuple(value.shape) != spec.local_shape:
                raise CheckpointError(
                    f"optimizer state {name!r}/{key!r} must be a tensor shaped like the "
                    f"parameter's shard {spec.local_shape}, got "
                    f"{tuple(value.shape) if torch.is_tensor(value) else type(value).__name__}; "
                    f"scalars belong under {OPTIMIZER_GLOBAL_KEY!r}")
            optim.append(_entry(f"optim/{name}/{key}", value, spec, copy, seen, staging))
    p = run.parallel
    info = {"tp_rank": p.tp_rank, "pp_rank": p.pp_rank, "dp_rank": p.dp_rank,
            "cp_rank": p.cp_rank}
    rng = get_rng_state(rng_tracker(run))
    snap = RankSnapshot(run.world.rank, {"model": model, "optim": optim}, rng, info)
    return snap, global_state


def layout_of(run) -> dict:
    p = run.parallel

    return {"world_size": p.world_size, "tp": p.tp_size, "pp": p.pp_size, "vp": p.vp_size,
            "cp": p.cp_size, "ep": p.ep_size, "etp": p.etp_size, "dp": p.dp_size,
            "sequence_parallel": bool(run.config.parallel.sequence_parallel),
            # ep and etp mean something only for a model with expert parameters (inspect shows
            # them then); a layout records them anyway, for the RNG's rank mapping.
            "expert_parameters": any(is_expert(param) for chunk in run.model_chunks
                                     for param in chunk.parameters()),
            "optimizer": resolve_optimizer(run.config), "schedule": resolve_schedule(run.config)}


def same_layout(saved: dict, run) -> bool:
    """Whether the saved per-rank RNG states map one-to-one onto this run's ranks."""
    now = layout_of(run)
    keys = ("world_size", "tp", "pp", "vp", "cp", "ep", "etp")
    return all(saved.get(k) == now[k] for k in keys)


def rng_source_rank(saved: dict, manifests: dict[int, dict], run) -> int | None:
    """The saved rank whose RNG state this rank continues with, or None (then every rank is
    reseeded). The same layout maps rank to rank. A layout that differs only in cp maps by
    (tp, pp, dp) rank onto cp rank 0: cp ranks share every random stream (no seed depends on the
    cp rank, and they draw the same amounts), so any of them holds the state."""
    if same_layout(saved, run):
        return run.world.rank
    now = layout_of(run)
    if any(saved.get(k) != now[k] for k in ("tp", "pp", "vp", "ep", "etp", "dp")):
        return None
    p = run.parallel
    want = {"tp_rank": p.tp_rank, "pp_rank": p.pp_rank, "dp_rank": p.dp_rank, "cp_rank": 0}
    for rank, manifest in sorted(manifests.items()):
        info = manifest.get("info") or {}
        if all(info.get(k) == v for k, v in want.items()):
            return rank
    return None


def plugin_versions(config) -> dict:
    """The plugins the run selected, each with its distribution and version."""

    chosen = selected_drivers(config, (*DRIVER_ROLES, "layer_backend"))
    out: dict[str, dict] = {}
    for role, name in chosen.items():
        info = next((i for i in registry.available(role) if i.name == name), None)
        out[role] = {"name": name, "distribution": info.distribution if info else None,
                     "version": info.version if info else None}
    out["extensions"] = {i.name: {"distribution": i.distribution, "version": i.version}
                         for i in registry.available("extension")}
    return out


def plugtron_version() -> str:

    try:
        return metadata.version("plugtron")
    except metadata.PackageNotFoundError:
        return "unknown"


def base_metadata(config, iteration: int, consumed_samples: int, layout: dict,
                  contents: dict) -> dict:

    saved = config.to_dict()
    saved["plugins"].update(chosen_names(config))  # what ran, not `auto` (a run set up in-process)
    return {"format": FORMAT, "version": VERSION, "iteration": iteration,
            "consumed_samples": consumed_samples, "layout": layout,
            "config": saved, "plugins": plugin_versions(config),
            "contents": contents, "plugtron_version": plugtron_version(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_metadata(run, optimizer_state: dict, iteration: int | None = None) -> dict:

    iteration = run.state.iteration if iteration is None else iteration
    meta = base_metadata(run.config, iteration, run.state.consumed_samples,
                         layout_of(run), {"model": True, "optimizer": True, "rng": True})
    if base.saves_without_base(run):
        meta[base.BASE_KEY] = run.base_checkpoint
    meta["scheduler"] = run.scheduler.state_dict()
    meta["optimizer"] = encode(optimizer_state)
    return meta
