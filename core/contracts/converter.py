"""The converter contract (entry-point group ``plugtron.converters``): one model's mapping
between Hugging Face (and Megatron ``torch_dist``) tensors and plugtron's global tensors.

The core reads and writes the files, pads and unpads the vocabulary for tensor parallelism and
checks every tensor and shape (core/interchange/); the converter only renames, fuses and
splits. The HF tensor names live in the converter, never in the core.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import argparse

    import torch
    from plugtron.core.config import ModelConfig, TrainConfig

Tensors = Mapping[str, "torch.Tensor"]


class Converter(Protocol):
    """What every converter implements.

    Tensors on the plugtron side are full (unsharded), named as the model's parameters are
    (``decoder.layers.0.self_attention.linear_qkv.weight``), and vocabulary-sized tensors have
    exactly ``vocab_size`` rows (the core adds and removes tp padding).
    """

    #: plugtron names whose first dimension is the vocabulary.
    vocab_tensors: tuple[str, ...]

    def import_hf(self, hf_config: dict, tensors: Tensors) -> tuple[dict, dict]:
        """-> (plugtron settings as ``{flag name: value}``, ``{plugtron name: tensor}``).
        Raise ``ConfigError`` for a model this converter cannot represent.

        ``tensors`` is a read-only mapping that counts each ``tensors[name]``: the core then
        requires every tensor of the files read exactly once and checks every shape
        (core/interchange/hf_strict.py), so read through it (``in`` is free) rather than
        copying it."""
        ...

    def export_hf(self, model_config: ModelConfig, tensors: Tensors) -> tuple[dict, dict]:
        """-> (Hugging Face ``config.json`` dict, ``{hf name: tensor}``). A converter whose
        ``export_hf`` also takes a keyword ``config`` gets the whole ``TrainConfig`` there (its
        model's own option sections included, e.g. ``config.hybrid``)."""
        ...


class HFLinearMap(Protocol):
    """Which Hugging Face linear modules each of a model's linears is, for adapters that live
    beside linears (PEFT's): plugtron fuses some that Hugging Face keeps apart (q, k and v
    into ``linear_qkv``; a gated MLP's two input projections into ``linear_fc1``), always
    along the output features. Names are full module names
    (``decoder.layers.0.self_attention.linear_qkv`` -> ``model.layers.0.self_attn.q_proj``,
    ...)."""

    #: plugtron linear -> the Hugging Face modules its output features split into, in order.
    modules: dict[str, list[str]]

    def split(self, linear: str, rows: torch.Tensor) -> list[torch.Tensor]:
        """A tensor laid out along ``linear``'s output features (dim 0) -> one per module of
        ``modules[linear]``, each along that module's output features."""
        ...

    def fuse(self, linear: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        ...


class ConverterExtras(Protocol):
    """Members a converter may add; the core looks each up with ``getattr`` and does without.

    Typed here so that a plugin author (and a type checker) can see them; a converter
    implements any subset.
    """

    #: Regular expressions of file tensors that carry no weights (GPT-2's causal-mask
    #: buffers), accepted unread by the strict import.
    ignored_hf_tensors: tuple[str, ...]

    #: The HF ``model_type``\\ s it reads: ``plugtron convert import-hf`` picks the installed
    #: converter that declares config.json's ``model_type`` (and with it the model plugin,
    #: ``model``); ``--model`` only chooses between two that declare the same one. A converter
    #: without it is reached only by ``--model``, and ``plugins check`` warns.
    model_types: tuple[str, ...]

    #: The model plugin an imported checkpoint runs with (default: the converter's name).
    model: str

    @classmethod
    def handles(cls, config: TrainConfig) -> bool:
        """``export_hf`` uses this converter for a run config it claims."""
        ...

    def export_hf_from(self, config: TrainConfig, tensors: Tensors) -> tuple[dict, dict]:
        """Like ``export_hf`` with the whole run config (plugin sections included); preferred
        when present."""
        ...

    @classmethod
    def claims_megatron(cls, args: dict | None, given: dict) -> bool:
        """For a converter another plugin ships for a model it extends: ``import_megatron``
        uses it, instead of the ``--model`` plugin's, for a checkpoint whose saved Megatron
        ``args`` (None when it has none) and command-line settings ``given`` it claims
        (plugtron-moe's: ``num_experts``)."""
        ...

    def import_megatron(self, args: dict | None, given: dict, tensors: Tensors,
                        flag_names: Collection[str]) -> tuple[dict, dict]:
        """A Megatron-Core ``torch_dist`` checkpoint -> (flag values, ``{plugtron name:
        tensor}``). ``args``: the checkpoint's saved Megatron args (None when common.pt has
        none); ``given``: the settings from the command line; ``tensors``: the model's global
        tensors by Megatron key, assembled from whatever tp/pp layout saved them; ``flag_names``:
        the field names of the model's options. Every tensor must be used (the core refuses
        leftovers)."""
        ...

    def export_megatron(self, config: TrainConfig, tensors: Tensors,
                        padded_vocab: int) -> tuple[argparse.Namespace, dict]:
        """-> (the ``args`` Megatron saves, ``{torch_dist key: tensor}``)."""
        ...

    #: Parts of the model an export may leave out when asked (``plugtron convert export-hf
    #: / export-megatron --drop PART``), ``{part: what it is}``: e.g. the GPT converters'
    #: ``"mtp"``, the multi-token prediction layers, which inference engines do not run.
    droppable_parts: dict[str, str]

    def hf_linear_map(self, config: TrainConfig) -> HFLinearMap:
        """The Hugging Face modules of the linears of the model ``config`` describes (PEFT
        adapters: ``convert export-hf --adapter-only``, ``import-hf --peft-adapter``). Raise
        ``ConfigError`` for a layout whose linears PEFT cannot address as plugtron's
        (GPT-2's transposed ``Conv1D``); a converter without it writes and reads no adapters."""
        ...

    def drop_part(self, config: TrainConfig, part: str) -> None:
        """Change the checkpoint's run ``config`` so that the model it describes lacks
        ``part`` (one of ``droppable_parts``); the export then asks for none of its tensors
        and its config says the part is absent."""
        ...
