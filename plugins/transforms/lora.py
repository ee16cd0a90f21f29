"""Model transform ``lora``: low-rank adapters (LoRA) on the linears a model builds through its
layer backend, the rest of the model frozen.

``--lora-rank R`` turns it on (or ``--model-transforms lora``). Each linear whose module name
ends in one of ``--lora-target-modules`` (Megatron-Core's names: ``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``; any column- or row-parallel linear of the
backend by its name) gets an adapter, sharded to match it under tensor and sequence
parallelism (lora_adapter.py); one adapter covers a fused projection (qkv, [gate; up]), or,
with canonical LoRA's targets ``linear_q``, ``linear_k``, ``linear_v``, ``linear_fc1_gate``,
``linear_fc1_up``, one adapter per projection (lora_split.py). Every other parameter of the
chunk is frozen. Adapter parameters are named
``<linear>.adapter.linear_in.weight`` (A) and ``<linear>.adapter.linear_out.weight`` (B), as
Megatron-Bridge names them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import partial
from types import SimpleNamespace

import torch
from plugtron.api import ConfigError, ConfigSection, hookimpl, opt, reference_model

from .lora_adapter import attach_adapter, parallel_kind
from .lora_peft import from_peft, to_peft
from .lora_split import CANONICAL, PARTS, SplitAdapter, fuse_parts, part_features

#: The tensor-parallel view of an expert's adapter (whole on its ep rank): no collective.
WHOLE = SimpleNamespace(tp_size=1, tp_rank=0, tp_group=None)

NAME = "lora"
ROLE = "model_transform"
#: Megatron-Bridge's default targets: attention's and the MLP's linears.
DEFAULT_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@dataclass
class LoRAOptions:
    lora_rank: int = opt(0, "--lora-rank",
                         "LoRA: train rank-R adapters on the target linears, the rest of the "
                         "model frozen (0: off).")
    lora_alpha: float = opt(32.0, "--lora-alpha",
                            "LoRA scaling: an adapter's output is multiplied by alpha / rank.")
    lora_dropout: float = opt(0.0, "--lora-dropout", "Dropout on the adapters' input.")
    lora_target_modules: list = opt(list(DEFAULT_TARGETS), "--lora-target-modules",
                                    "Linears that get an adapter, by the last part of their "
                                    "module name (several values or comma-separated).")


SECTION = ConfigSection(NAME, LoRAOptions, title="LoRA (model transform)")


def lora_options(config) -> LoRAOptions:
    return getattr(config, NAME, None) or LoRAOptions()


def targets(options: LoRAOptions) -> list[str]:
    return [t.strip() for item in options.lora_target_modules for t in str(item).split(",")
            if t.strip()]


def split_targets(names: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(whole linears, {fused linear: its parts}) of the targets: canonical LoRA's names
    (``linear_q`` ...) adapt parts of a fused linear, which is then not a target itself."""
    parts: dict[str, list[str]] = {}
    for name in names:
        if name in CANONICAL:
            fused, part = CANONICAL[name]
            parts.setdefault(fused, []).append(part)
    both = sorted(set(parts) & set(names))
    if both:
        raise ConfigError(f"--lora-target-modules names {both[0]} and its parts "
                          f"({', '.join(t for t, (f, _) in CANONICAL.items() if f == both[0])}): "
                          f"give one adapter on the fused linear, or one per part")
    return [n for n in names if n not in CANONICAL], parts


def _named(config) -> bool:
    return any(NAME in str(item).split(",") for item in config.plugins.model_transforms)


class LoRA:
    """Options, selection and validation are static (the class is always collected); the
    transform itself runs on the instance the run registers."""

    @staticmethod
    def plugtron_config_sections():
        return [SECTION]

    @staticmethod
    def plugtron_select(role, config):
        if role == ROLE and lora_options(config).lora_rank > 0:
            return NAME
        return None

    @staticmethod
    def plugtron_validate(config, world_size):
        o = lora_options(config)
        if o.lora_rank == 0 and not _named(config):
            default = LoRAOptions()
            given = [f.metadata["flag"] for f in fields(LoRAOptions)
                     if getattr(o, f.name) != getattr(default, f.name)]
            if given:
                raise ConfigError(f"{', '.join(given)} without --lora-rank: LoRA is off; give "
                                  f"--lora-rank R (> 0) to train adapters")
            return
        if o.lora_rank <= 0:
            raise ConfigError(f"--lora-rank must be a positive rank when LoRA is on, got "
                              f"{o.lora_rank}")
        if o.lora_alpha <= 0:
            raise ConfigError(f"--lora-alpha must be positive, got {o.lora_alpha}")
        if not 0.0 <= o.lora_dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {o.lora_dropout}")
        if not targets(o):
            raise ConfigError("--lora-target-modules names no module")
        split_targets(targets(o))
        p = config.parallel
        if p.pipeline_model_parallel_size > 1 or p.virtual_pipeline_model_parallel_size:
            # a pipeline stage may lack what another holds: the targets against every layer
            whole = reference_model(config)
            _check_targets(o, {name: kind for name, sub in whole.named_modules()
                               if (kind := parallel_kind(sub)) is not None})
        tp = config.parallel.tensor_model_parallel_size
        if o.lora_rank % tp:
            # the A of a column-parallel linear is split over its rank (Megatron-Bridge's way)
            raise ConfigError(f"--lora-rank {o.lora_rank} does not split over tp {tp}: an "
                              f"adapter's A is sharded over its rank; give a multiple of {tp}")

    @hookimpl
    def transform_model_chunk(self, config, module, layer_backend, parallel):
        o = lora_options(config)
        wanted, parts = split_targets(targets(o))
        linears = {name: kind for name, sub in module.named_modules()
                   if (kind := parallel_kind(sub)) is not None}
        chosen = {name: kind for name, kind in linears.items()
                  if name.rpartition(".")[2] in wanted or name.rpartition(".")[2] in parts}
        if parallel.pp_size == 1 and not parallel.vp_size:  # else checked on the whole model
            _check_targets(o, linears)
        modules = dict(module.named_modules())
        adapters = []
        for name, kind in chosen.items():
            owner = parallel
            if getattr(modules[name].weight, "allreduce", True) is False:
                if parallel.etp_size > 1:
                    raise ConfigError(f"--lora-target-modules: {name} is an expert's linear, "
                                      f"split over expert tensor parallelism "
                                      f"{parallel.etp_size}; LoRA on experts needs "
                                      f"--expert-tensor-parallel-size 1")
                owner = WHOLE  # each expert whole on its ep rank: the adapter's too
            fused = name.rpartition(".")[2]
            split = (partial(SplitAdapter, parts=parts[fused], model=config.model)
                     if fused in parts else None)
            adapters.append(attach_adapter(
                modules[name], name, kind, split, rank=o.lora_rank, alpha=o.lora_alpha,
                dropout=o.lora_dropout, seed=config.training.seed,
                layer_backend=layer_backend, parallel=owner))
        trained = {id(p) for adapter in adapters for p in adapter.parameters()}
        for param in module.parameters():
            if id(param) not in trained:
                param.requires_grad_(False)
        return module

    @hookimpl
    def transform_merged_tensors(self, config, tensors):
        o = lora_options(config)
        return MergedLoRA(tensors, o.lora_alpha / o.lora_rank, config.model)

    @hookimpl
    def transform_peft_adapter(self, config, tensors, linears):
        return to_peft(config, lora_options(config), tensors, linears)

    @hookimpl
    def transform_from_peft_adapter(self, adapter_config, tensors, linears, base):
        if adapter_config.get("peft_type") != "LORA":
            return None
        return from_peft(adapter_config, tensors, linears, base)


#: Names of an adapter's matrices after their linear's module name (canonical LoRA's parts:
#: ``.adapter.adapter_<part>.linear_in.weight``).
A_SUFFIX, B_SUFFIX = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
ADAPTER_TENSOR = re.compile(r"\.adapter\.(adapter_\w+\.)?linear_(in|out)\.weight$")


def adapter_delta(tensors: Mapping, linear: str, weight: torch.Tensor, model) -> torch.Tensor:
    """``B @ A`` of ``linear``'s adapter (fp32), its parts' fused as the linear's output."""
    if linear + A_SUFFIX in tensors:
        return tensors[linear + B_SUFFIX].float() @ tensors[linear + A_SUFFIX].float()
    fused = linear.rpartition(".")[2]
    features = part_features(fused, linear, weight.shape[0], model)
    deltas = []
    for part in PARTS[fused]:
        prefix = f"{linear}.adapter.adapter_{part}"
        deltas.append(tensors[f"{prefix}.linear_out.weight"].float()
                      @ tensors[f"{prefix}.linear_in.weight"].float()
                      if f"{prefix}.linear_in.weight" in tensors
                      else torch.zeros(features[part], weight.shape[1]))
    return fuse_parts(fused, deltas, model, dim=0)


class MergedLoRA(Mapping):
    """The plain model's tensors: each adapted linear's weight with ``alpha / r * B @ A``
    added (in fp32, then its own dtype), the adapters left out; read as asked for."""

    def __init__(self, tensors: Mapping, scale: float, model):
        self.tensors, self.scale, self.model = tensors, scale, model
        self.names = [n for n in tensors if not ADAPTER_TENSOR.search(n)]
        self.adapted = {n[:ADAPTER_TENSOR.search(n).start()] + ".weight"  # type: ignore[union-attr]
                        for n in tensors if ADAPTER_TENSOR.search(n)}

    def __getitem__(self, name):
        if ADAPTER_TENSOR.search(name):
            raise KeyError(name)
        weight = self.tensors[name]
        if name not in self.adapted:
            return weight
        delta = adapter_delta(self.tensors, name.removesuffix(".weight"), weight, self.model)
        return (weight.float() + self.scale * delta).to(weight.dtype)

    def __contains__(self, name):
        return name in self.tensors and not ADAPTER_TENSOR.search(str(name))

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def _check_targets(o, linears: dict) -> None:
    """Refuse target modules the model has no linear for (``linears``: name -> kind)."""
    wanted, parts = split_targets(targets(o))
    found = {name.rpartition(".")[2] for name in linears
             if name.rpartition(".")[2] in wanted or name.rpartition(".")[2] in parts}
    missing = sorted(set(wanted) - found) + sorted(
        t for t, (fused, _) in CANONICAL.items() if fused in parts and t in targets(o)
        and fused not in found)
    if missing:
        have = sorted({name.rpartition(".")[2] for name in linears})
        raise ConfigError(f"--lora-target-modules {', '.join(missing)}: the model has no "
                          f"such linear; its linears are {', '.join(have) or 'none'}")
