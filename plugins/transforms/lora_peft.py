"""LoRA's adapters in PEFT's adapter format (``peft_type`` ``LORA``), both ways.

PEFT adapts Hugging Face's modules one by one; plugtron's one adapter on a fused linear (q, k,
v in ``linear_qkv``, gate and up in ``linear_fc1``) is, exactly, one adapter per module with
the same ``lora_A`` and its part of ``lora_B`` (``B A x`` split along the output features).
Canonical LoRA's per-projection adapters are PEFT's per-module ones as they are. Read back, a
fused linear whose modules share one ``lora_A`` in every layer gets one adapter; otherwise
(different A's, or some of its modules adapted) canonical adapters, per module. Anything else
PEFT can say that plugtron's LoRA cannot compute is refused naming the setting.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from plugtron.api import ConfigError

from .lora_split import CANONICAL, PARTS

#: (fused linear, part) -> canonical LoRA's target name
CANONICAL_NAMES = {value: name for name, value in CANONICAL.items()}

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
    for linear, part, prefix in _canonical_adapters(tensors):
        modules = linears.modules.get(linear)
        if modules is None:
            raise ConfigError(f"--adapter-only: {linear} is not a linear of the Hugging Face "
                              f"layout the model exports as; PEFT cannot address its adapter")
        module = modules[PARTS[linear.rpartition(".")[2]].index(part)]
        weights[PREFIX + module + LORA_A] = tensors[prefix + ".linear_in.weight"]
        weights[PREFIX + module + LORA_B] = tensors[prefix + ".linear_out.weight"]
        targets.add(module.rpartition(".")[2])
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": options.lora_rank,
                      "lora_alpha": options.lora_alpha, "lora_dropout": options.lora_dropout,
                      "target_modules": sorted(targets), "base_model_name_or_path": None,
                      "inference_mode": True, **PLAIN}
    return adapter_config, weights


def _canonical_adapters(tensors: Mapping) -> list[tuple[str, str, str]]:
    """(linear, part, the part adapter's module name) of canonical LoRA's tensors."""
    out = []
    for name in tensors:
        head, sep, tail = name.partition(".adapter.adapter_")
        if sep and tail.endswith(".linear_in.weight"):
            part = tail.removesuffix(".linear_in.weight")
            out.append((head, part, f"{head}.adapter.adapter_{part}"))
    return sorted(out)


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


def _one_adapter(modules: list[str], found: Mapping) -> bool:
    """Whether a fused linear's modules all have adapters with one common A."""
    if any(m not in found for m in modules):
        return False
    a = found[modules[0]]["A"]
    return all(torch.equal(found[m]["A"], a) for m in modules[1:])


def _check_shapes(a, b, rank: int, weight_shape, what: str) -> None:
    out_features, in_features = weight_shape
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise ConfigError(f"adapter_model.safetensors: the adapter of {what} has A "
                          f"{list(a.shape)}, B {list(b.shape)}; r {rank} over its weight "
                          f"{[out_features, in_features]} needs A {[rank, in_features]}, "
                          f"B {[out_features, rank]}")


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
    adapted = sorted({owner[m] for m in found})
    # One adapter on a fused linear where every layer's modules share one A; else canonical
    # LoRA's adapter per module, for every linear of that name.
    canonical = {linear.rpartition(".")[2] for linear in adapted
                 if not _one_adapter(linears.modules[linear], found)}
    out: dict[str, torch.Tensor] = {}
    names = set()
    for linear in adapted:
        modules, kind = linears.modules[linear], linear.rpartition(".")[2]
        weight = base[linear + ".weight"]
        if kind in canonical and kind in PARTS:
            for module, part, rows in zip(modules, PARTS[kind],
                                          linears.split(linear, weight), strict=True):
                if module in found:
                    a, b = found[module]["A"], found[module]["B"]
                    _check_shapes(a, b, rank, rows.shape, module)
                    prefix = f"{linear}.adapter.adapter_{part}"
                    out[prefix + ".linear_in.weight"], out[prefix + ".linear_out.weight"] = a, b
                    names.add(CANONICAL_NAMES[kind, part])
            continue
        if kind in canonical:
            raise ConfigError(f"adapter_model.safetensors: {modules[0]} has no adapter")
        a = found[modules[0]]["A"]
        b = linears.fuse(linear, [found[m]["B"] for m in modules])
        _check_shapes(a, b, rank, weight.shape, ", ".join(modules))
        out[linear + ADAPTER_A], out[linear + ADAPTER_B] = a, b
        names.add(kind)
    # plugtron adapts every linear (or part) of a targeted name: so must the file
    for linear, modules in linears.modules.items():
        kind = linear.rpartition(".")[2]
        wanted = ([m for m, p in zip(modules, PARTS[kind])
                   if CANONICAL_NAMES[kind, p] in names] if kind in canonical
                  else modules if kind in names else [])
        lacking = [m for m in wanted if m not in found]
        if lacking:
            raise ConfigError(f"adapter_model.safetensors has no adapter for {lacking[0]}; "
                              f"plugtron's LoRA adapts every "
                              f"{lacking[0].rpartition('.')[2]} (layers_to_transform-like "
                              f"subsets are not supported)")
    if not out:
        raise ConfigError("adapter_model.safetensors holds no adapter")
    flags = {"lora-rank": rank, "lora-alpha": alpha,
             "lora-dropout": float(c.get("lora_dropout") or 0.0),
             "lora-target-modules": sorted(names)}
    return flags, out
