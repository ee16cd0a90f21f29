"""LoRA's adapters in PEFT's adapter format (``peft_type`` ``LORA``), both ways.

PEFT adapts Hugging Face's modules one by one; plugtron's one adapter on a fused linear (q, k,
v in ``linear_qkv``, gate and up in ``linear_fc1``) is, exactly, one adapter per module with
the same ``lora_A`` and its part of ``lora_B`` (``B A x`` split along the output features).
Read back, a fused linear needs an adapter on each of its modules with one common ``lora_A``;
anything else PEFT can say that plugtron's LoRA cannot compute is refused naming the setting.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from plugtron.api import ConfigError

#: PEFT's key of one module's adapter matrix: ``{PREFIX}{module}.lora_A.weight``.
PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
ADAPTER_A, ADAPTER_B = ".adapter.linear_in.weight", ".adapter.linear_out.weight"

#: adapter_config.json settings (peft 0.21) whose value other than these changes what the
#: adapter computes, or where, in a way plugtron's LoRA does not; the variants' own sections
#: (``*_config``) too, unless they only choose an initialisation (``init_lora_weights``,
#: ``loftq_config``, ``eva_config``, ``corda_config``, ``lora_ga_config``: ignored).
PLAIN = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
         "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
         "layers_to_transform": None, "layers_pattern": None, "lora_bias": False,
         "use_qalora": False, "target_parameters": None, "trainable_token_indices": None,
         "megatron_config": None, "alora_invocation_tokens": None, "layer_replication": None,
         "use_bdlora": None, "arrow_config": None, "kasa_config": None, "velora_config": None,
         "monteclora_config": None}


def to_peft(config, options, tensors: Mapping, linears) -> tuple[dict, dict]:
    adapted = sorted(n.removesuffix(ADAPTER_A) for n in tensors if n.endswith(ADAPTER_A))
    weights: dict[str, torch.Tensor] = {}
    targets = set()
    for linear in adapted:
        modules = linears.modules.get(linear)
        if modules is None:
            raise ConfigError(f"--adapter-only: {linear} is not a linear of the Hugging Face "
                              f"layout the model exports as; PEFT cannot address its adapter")
        a, b = tensors[linear + ADAPTER_A], tensors[linear + ADAPTER_B]
        for module, b_part in zip(modules, linears.split(linear, b), strict=True):
            weights[PREFIX + module + LORA_A] = a
            weights[PREFIX + module + LORA_B] = b_part
            targets.add(module.rpartition(".")[2])
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": options.lora_rank,
                      "lora_alpha": options.lora_alpha, "lora_dropout": options.lora_dropout,
                      "target_modules": sorted(targets), "base_model_name_or_path": None,
                      "inference_mode": True, **PLAIN}
    return adapter_config, weights


def _refuse_settings(c: dict) -> None:
    for key, plain in PLAIN.items():
        value = c.get(key, plain)
        if value != plain and not (plain is None and value in ({}, [], "", False)) \
                and not (plain == {} and value is None):
            raise ConfigError(f"adapter_config.json: {key} {value!r} cannot be expressed by "
                              f"plugtron's LoRA (it needs {key} {plain!r})")
    for key in ("r", "lora_alpha"):
        value = c.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"adapter_config.json: {key} must be a positive number, got "
                              f"{value!r}")


def _module_adapters(tensors: Mapping) -> dict[str, dict[str, torch.Tensor]]:
    """``{hf module: {"A": .., "B": ..}}`` of the file's keys; any other key is refused."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for suffix, which in ((LORA_A, "A"), (LORA_B, "B")):
            if key.startswith(PREFIX) and key.endswith(suffix):
                found.setdefault(key[len(PREFIX):-len(suffix)], {})[which] = tensor
                break
        else:
            raise ConfigError(f"adapter_model.safetensors: {key!r} is not a LoRA matrix of a "
                              f"linear ({PREFIX}<module>{LORA_A} / {LORA_B}); plugtron's LoRA "
                              f"cannot express it")
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"adapter_model.safetensors: {module} has lora_"
                              f"{''.join(pair)} without its other matrix")
    return found


def from_peft(c: dict, tensors: Mapping, linears, base: Mapping) -> tuple[dict, dict]:
    _refuse_settings(c)
    rank, alpha = int(c["r"]), float(c["lora_alpha"])
    found = _module_adapters(tensors)
    owner = {module: linear for linear, modules in linears.modules.items()
             for module in modules}
    unknown = sorted(m for m in found if m not in owner)
    if unknown:
        raise ConfigError(f"adapter_config.json target_modules: {unknown[0]} is not a linear "
                          f"plugtron's LoRA adapts (it adapts "
                          f"{', '.join(sorted({m.rpartition('.')[2] for m in owner}))})")
    out: dict[str, torch.Tensor] = {}
    for linear in sorted({owner[m] for m in found}):
        modules = linears.modules[linear]
        lacking = [m for m in modules if m not in found]
        if lacking:
            raise ConfigError(f"adapter_config.json target_modules: adapts "
                              f"{', '.join(m for m in modules if m in found)} but not "
                              f"{', '.join(lacking)}; plugtron fuses them into one linear "
                              f"({linear}) with one adapter")
        a = found[modules[0]]["A"]
        if any(not torch.equal(found[m]["A"], a) for m in modules[1:]):
            raise ConfigError(f"adapter_model.safetensors: the lora_A of "
                              f"{', '.join(modules)} differ; plugtron's one adapter on the "
                              f"fused {linear} has a single A (per-projection adapters are "
                              f"not supported yet)")
        b = linears.fuse(linear, [found[m]["B"] for m in modules])
        weight = base[linear + ".weight"]
        if tuple(a.shape) != (rank, weight.shape[1]) or tuple(b.shape) != (weight.shape[0], rank):
            raise ConfigError(f"adapter_model.safetensors: the adapter of {', '.join(modules)} "
                              f"has A {list(a.shape)}, B {list(b.shape)}; r {rank} over the "
                              f"base's {list(weight.shape)} needs A {[rank, weight.shape[1]]}, "
                              f"B {[weight.shape[0], rank]}")
        out[linear + ADAPTER_A], out[linear + ADAPTER_B] = a, b
    names = {linear.rpartition(".")[2] for linear in (n.removesuffix(ADAPTER_A) for n in out
                                                      if n.endswith(ADAPTER_A))}
    # plugtron adapts every linear of a targeted name: so must the file
    missing = sorted(linear for linear in linears.modules
                     if linear.rpartition(".")[2] in names and linear + ADAPTER_A not in out)
    if missing:
        raise ConfigError(f"adapter_model.safetensors has no adapter for "
                          f"{', '.join(linears.modules[missing[0]])}; plugtron's LoRA adapts "
                          f"every {missing[0].rpartition('.')[2]} (layers_to_transform-like "
                          f"subsets are not supported)")
    if not out:
        raise ConfigError("adapter_model.safetensors holds no adapter")
    flags = {"lora-rank": rank, "lora-alpha": alpha,
             "lora-dropout": float(c.get("lora_dropout") or 0.0),
             "lora-target-modules": sorted(names)}
    return flags, out
