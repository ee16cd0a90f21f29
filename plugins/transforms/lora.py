"""Model transform ``lora``: low-rank adapters (LoRA) on the linears a model builds through its
layer backend, the rest of the model frozen.

``--lora-rank R`` turns it on (or ``--model-transforms lora``). Each linear whose module name
ends in one of ``--lora-target-modules`` (Megatron-Core's names: ``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``; any column- or row-parallel linear of the
backend by its name) gets an adapter, sharded to match it under tensor and sequence
parallelism (lora_adapter.py); one adapter covers a fused projection (qkv, [gate; up]). Every
other parameter of the chunk is frozen. Adapter parameters are named
``<linear>.adapter.linear_in.weight`` (A) and ``<linear>.adapter.linear_out.weight`` (B), as
Megatron-Bridge names them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from plugtron.api import ConfigError, ConfigSection, hookimpl, opt

from .lora_adapter import attach_adapter, parallel_kind
from .lora_peft import from_peft, to_peft

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
        tp = config.parallel.tensor_model_parallel_size
        if o.lora_rank % tp:
            # the A of a column-parallel linear is split over its rank (Megatron-Bridge's way)
            raise ConfigError(f"--lora-rank {o.lora_rank} does not split over tp {tp}: an "
                              f"adapter's A is sharded over its rank; give a multiple of {tp}")

    @hookimpl
    def transform_model_chunk(self, config, module, layer_backend, parallel):
        o = lora_options(config)
        wanted = targets(o)
        linears = {name: kind for name, sub in module.named_modules()
                   if (kind := parallel_kind(sub)) is not None}
        chosen = {name: kind for name, kind in linears.items()
                  if name.rpartition(".")[2] in wanted}
        whole_model = parallel.pp_size == 1 and not parallel.vp_size
        missing = sorted(set(wanted) - {name.rpartition(".")[2] for name in chosen})
        if missing and whole_model:  # a pipeline stage may lack what another holds
            have = sorted({name.rpartition(".")[2] for name in linears})
            raise ConfigError(f"--lora-target-modules {', '.join(missing)}: the model has no "
                              f"such linear; its linears are {', '.join(have) or 'none'}")
        modules = dict(module.named_modules())
        adapters = []
        for name, kind in chosen.items():
            if getattr(modules[name].weight, "allreduce", True) is False:
                raise ConfigError(f"--lora-target-modules: {name} is an expert's linear; LoRA "
                                  f"on experts is not supported yet")
            adapters.append(attach_adapter(
                modules[name], name, kind, rank=o.lora_rank, alpha=o.lora_alpha,
                dropout=o.lora_dropout, seed=config.training.seed,
                layer_backend=layer_backend, parallel=parallel))
        trained = {id(p) for adapter in adapters for p in adapter.parameters()}
        for param in module.parameters():
            if id(param) not in trained:
                param.requires_grad_(False)
        return module

    @hookimpl
    def transform_merged_tensors(self, config, tensors):
        o = lora_options(config)
        return MergedLoRA(tensors, o.lora_alpha / o.lora_rank)

    @hookimpl
    def transform_peft_adapter(self, config, tensors, linears):
        return to_peft(config, lora_options(config), tensors, linears)

    @hookimpl
    def transform_from_peft_adapter(self, adapter_config, tensors, linears, base):
        if adapter_config.get("peft_type") != "LORA":
            return None
        return from_peft(adapter_config, tensors, linears, base)


#: Names of an adapter's matrices after their linear's module name.
A_SUFFIX, B_SUFFIX = ".adapter.linear_in.weight", ".adapter.linear_out.weight"


class MergedLoRA(Mapping):
    """The plain model's tensors: each adapted linear's weight with ``alpha / r * B @ A``
    added (in fp32, then its own dtype), the adapters left out; read as asked for."""

    def __init__(self, tensors: Mapping, scale: float):
        self.tensors, self.scale = tensors, scale
        self.names = [n for n in tensors if not n.endswith((A_SUFFIX, B_SUFFIX))]
        self.adapted = {n.removesuffix(A_SUFFIX) + ".weight" for n in tensors
                        if n.endswith(A_SUFFIX)}

    def __getitem__(self, name):
        if name.endswith((A_SUFFIX, B_SUFFIX)):
            raise KeyError(name)
        weight = self.tensors[name]
        if name not in self.adapted:
            return weight
        linear = name.removesuffix(".weight")
        a, b = self.tensors[linear + A_SUFFIX], self.tensors[linear + B_SUFFIX]
        return (weight.float() + self.scale * (b.float() @ a.float())).to(weight.dtype)

    def __contains__(self, name):
        return name in self.tensors and not str(name).endswith((A_SUFFIX, B_SUFFIX))

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)
