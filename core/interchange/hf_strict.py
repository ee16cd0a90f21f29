"""Strict Hugging Face import: every source tensor used exactly once, every shape as the config
says.

A converter maps names; it cannot be trusted to notice a file that disagrees with its own
config.json (a transposed ``k_proj`` reshapes silently into the fused QKV, a layer the config
does not count is simply never read). So the core checks, for every converter alike:

* **reads**: the converter sees the files through :class:`SourceTensors`, which counts every
  ``tensors[name]``; after the import each tensor of the files must have been read exactly once
  (tensors that carry no weights, e.g. GPT-2's causal-mask buffers, are named by the
  converter's optional ``ignored_hf_tensors`` regular expressions);
* **the files' shapes**: the imported tensors are exported back through the same converter on
  the meta device (shapes only, no memory), which gives the name and shape config.json implies
  for every Hugging Face tensor; each source tensor must have exactly that shape;
* **the model's shapes**: the model is built from the imported config on the meta device; the
  converted tensors must be exactly its state-dict entries with its shapes (vocabulary tensors:
  ``vocab_size`` rows before the core pads them).

Any disagreement is a ``CheckpointError`` naming the tensor (exit 2 from the CLI).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Mapping

import torch
from plugtron.core.errors import CheckpointError, ConfigError
from plugtron.core.interchange.converters import run_export
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.shared_params import group_of
from plugtron.core.training.builder import build_model, reference_backend

#: How many names an error lists before summing up the rest.
SHOWN = 8


class SourceTensors(Mapping):
    """The tensors of a Hugging Face directory, counting each ``[name]`` / ``get(name)``.

    ``in``, ``keys()`` and iteration do not count (looking is not using); ``items()`` and
    ``values()`` do not either, so a converter that copies the mapping instead of reading
    through it shows up as leaving every tensor unused rather than passing unchecked."""

    def __init__(self, tensors: dict):
        self._tensors = tensors
        self.reads: Counter = Counter()

    def __getitem__(self, name):
        tensor = self._tensors[name]
        self.reads[name] += 1
        return tensor

    def __contains__(self, name):
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self):
        return len(self._tensors)

    def items(self):
        return self._tensors.items()

    def values(self):
        return self._tensors.values()

    def shape(self, name) -> tuple:
        return tuple(self._tensors[name].shape)


def _listed(names) -> str:
    names = sorted(names)
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


_LAYER = re.compile(r"\blayers?\.(\d+)\.|\bh\.(\d+)\.")


def _layer_hint(names, flags: dict) -> str:
    layers = flags.get("num-layers")
    found = {int(a or b) for n in names for a, b in _LAYER.findall(n)}
    if isinstance(layers, int) and found and max(found) >= layers:
        return (f"; config.json gives {layers} layer(s) but the files hold layers 0..."
                f"{max(found)}: the layer count disagrees with the weights")
    return ""


def check_reads(source: SourceTensors, converter, flags: dict, where: str) -> None:
    """Every tensor of the files read exactly once by the converter."""
    ignored = [re.compile(p) for p in getattr(converter, "ignored_hf_tensors", ())]
    unused = [n for n in source if not source.reads[n]
              and not any(p.fullmatch(n) for p in ignored)]
    if unused:
        raise CheckpointError(
            f"{where}: {len(unused)} tensor(s) of the weight files are not part of the model "
            f"config.json describes: {_listed(unused)}{_layer_hint(unused, flags)}. Every "
            f"tensor must map onto the model exactly once; remove them or fix config.json")
    twice = [n for n, count in source.reads.items() if count > 1]
    if twice:
        raise CheckpointError(f"{where}: the converter read {_listed(twice)} more than once; "
                              f"each source tensor maps to exactly one place (a converter bug)")


def expected_shapes(config, vocab_tensors, flags: dict, where: str) -> dict[str, tuple]:
    """The model's state-dict shapes, vocabulary tensors with ``vocab_size`` rows (as a
    converter gives and takes them). Settings that build no model are config.json's fault."""
    empty = sorted(flag for flag, value in flags.items() if value is None)
    if empty:
        raise CheckpointError(f"{where}: gives no value (null) for the model's "
                              f"{', '.join('--' + f for f in empty)}")
    try:
        shapes = model_shapes(config)
    except ConfigError as exc:  # the model refuses these settings
        raise CheckpointError(f"{where}: {exc}") from None
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError, OverflowError) as exc:
        settings = ", ".join(f"--{k} {v!r}" for k, v in sorted(flags.items())
                             if isinstance(v, (int, float)) and not isinstance(v, bool))
        raise CheckpointError(f"{where}: its sizes build no model ({type(exc).__name__}: "
                              f"{exc}); the sizes it gives: {settings}") from None
    for name in vocab_tensors:
        if name in shapes:
            shapes[name] = (config.model.vocab_size,) + shapes[name][1:]
    return shapes


def check_source_shapes(source: SourceTensors, exported: dict, vocab_size: int,
                        where: str) -> None:
    """Each source tensor has the shape the config implies (the meta export's shape for the
    same name). A name the export writes differently (a legacy per-expert layout, GPT-2 files
    without the ``transformer.`` prefix) is matched by a unique suffix, else left to the
    model-shape check."""
    by_suffix: dict[str, list] = {}
    for name in exported:
        parts = name.split(".")
        for i in range(1, len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), []).append(name)
    for name in sorted(source.reads):
        target = name if name in exported else None
        if target is None and len(by_suffix.get(name, ())) == 1:
            target = by_suffix[name][0]
        if target is None:
            continue
        want, got = tuple(exported[target].shape), source.shape(name)
        if want != got:
            hint = " (transposed?)" if len(want) == 2 and want == got[::-1] else ""
            if want[0] == vocab_size and want[:1] != got[:1] and want[1:] == got[1:]:
                hint = f" ({got[0]} rows, but field vocab_size is {want[0]})"
            raise CheckpointError(f"{where}: tensor {name} has shape {list(got)}, but "
                                  f"config.json implies {list(want)}{hint}")


def exported_shapes(converter, config, shapes: dict, dtype) -> dict | None:
    """``{hf name: meta tensor}`` the converter's export writes for a model of these shapes:
    the Hugging Face files config.json implies. None where the converter cannot export this
    model (then only the model shapes are checked)."""
    meta = {k: torch.empty(v, dtype=dtype, device="meta") for k, v in shapes.items()}
    try:
        return run_export(converter, config, meta)[1]
    except ConfigError:
        return None
    except Exception as exc:  # noqa: BLE001 - a converter whose export needs real values
        print(f"warning: the shapes of the Hugging Face files were not checked: the "
              f"converter's export does not run on shapes alone ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return None


def model_shapes(config) -> dict[str, tuple]:
    """Name -> shape of every state-dict entry of the model ``config`` builds in one process
    (tp 1, pp 1, a backend that builds anywhere), built on the meta device: no memory, no init
    cost."""
    parallel = ParallelContext.build(1, 0, device=torch.device("cpu"))
    with torch.device("meta"):
        # The plain model: the files hold no transform's tensors.
        (module,) = build_model(config, parallel, layer_backend=reference_backend(config),
                                transforms=False)
    out: dict[str, tuple] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        out.setdefault(group_of(tensor) or name, tuple(tensor.shape))
    return out


def check_model_shapes(tensors: dict, expected: dict, where: str) -> None:
    """The converted tensors are exactly the model's entries (:func:`expected_shapes`), with
    its shapes."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: the weight files give no value for the model's "
                              f"{_listed(missing)}")
    if extra:
        raise CheckpointError(f"{where}: the converter produced {_listed(extra)}, which the "
                              f"model config.json describes does not have")
    for name, tensor in sorted(tensors.items()):
        want = expected[name]
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{where}: converted tensor {name} has shape "
                                  f"{list(tensor.shape)}, but the model config.json describes "
                                  f"needs {list(want)}")
