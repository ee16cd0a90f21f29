"""Megatron's per-sample flags: ``--reset-position-ids``, ``--reset-attention-mask``,
``--eod-mask-loss``, and the function that applies them to one sample. Public
(``plugtron.api``): a dataset of any distribution declares ``SAMPLE_SECTION`` among its config
sections, calls ``validate_sample_options`` in its ``plugtron_validate`` and builds its samples
with ``sample_from_window``, and the flags then work for it as for the built-in ones.

They follow Megatron-Core's ``_get_ltor_masks_and_position_ids``: an end-of-document token at
position ``i`` belongs to the document it ends, so the next document starts at ``i + 1``.
Instead of Megatron's ``[1, seq, seq]`` boolean mask, a sample carries ``attention_mask`` as the
1-D document number of each token (the dataset contract's sample is 1-D); attention lets a
token see the earlier tokens with the same number, which is exactly the mask Megatron builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from plugtron.core.config import ConfigSection, opt
from plugtron.core.errors import ConfigError
from plugtron.core.plugins.registry import load
from plugtron.core.plugins.selection import selected_driver


@dataclass
class SampleOptions:
    reset_position_ids: bool = opt(False, "--reset-position-ids",
                                   "Position ids restart after each end-of-document token.",
                                   is_flag=True)
    reset_attention_mask: bool = opt(False, "--reset-attention-mask",
                                     "Tokens do not attend across end-of-document tokens.",
                                     is_flag=True)
    eod_mask_loss: bool = opt(False, "--eod-mask-loss",
                              "No loss where the input token is end-of-document.", is_flag=True)


SAMPLE_SECTION = ConfigSection("samples", SampleOptions, title="Sample masks and positions")


def documents_masked(config) -> str | None:
    """What makes this run's samples carry document numbers (``attention_mask``), or None: the
    flag ``--reset-attention-mask``, or the selected dataset packing several documents into a
    sequence (its driver's ``packs_documents(config)`` names the option that does). Models and
    backends that cannot keep documents apart refuse the run when this is not None."""
    options = getattr(config, "samples", None)
    if options is not None and options.reset_attention_mask:
        return "--reset-attention-mask"
    try:
        dataset = load("dataset", selected_driver(config, "dataset"))
    except Exception:  # noqa: BLE001 - an unknown dataset is refused where it is selected
        return None
    packs = getattr(dataset, "packs_documents", None)
    return packs(config) if callable(packs) else None


def validate_sample_options(config) -> None:
    """Before launch: document numbers (``--reset-attention-mask``, or a dataset that packs)
    need an attention that reads them. The built-in backends' do, with context parallelism too
    (every comm type); a backend that does not declare ``supports_document_ids`` is refused
    rather than silently attending across documents."""
    why = documents_masked(config)
    if why is None:
        return
    name = selected_driver(config, "layer_backend")
    backend = load("layer_backend", name)
    if not getattr(backend, "supports_document_ids", False):
        raise ConfigError(f"{why} is not supported by --layer-backend {name}: its attention "
                          f"does not mask documents; use --layer-backend local")


def document_runs(document_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per sample of ``document_ids`` (``[b, s]``, a batch's ``attention_mask``), ``(start,
    end)`` of each run of one document number: what a layer that handles each document on its
    own (attention, a recurrent scan) iterates over."""
    ids = document_ids.to("cpu")
    cuts: list[list[int]] = [[] for _ in range(ids.shape[0])]
    for row, at in (ids[:, 1:] != ids[:, :-1]).nonzero().tolist():
        cuts[row].append(at + 1)
    length = ids.shape[1]
    return [list(zip([0, *c], [*c, length])) for c in cuts]


def document_numbers(tokens: np.ndarray, eod: int) -> np.ndarray:
    """For each position, how many end-of-document tokens come strictly before it."""
    is_eod = tokens == eod
    numbers = np.zeros(len(tokens), dtype=np.int64)
    np.cumsum(is_eod[:-1], out=numbers[1:])
    return numbers


def sample_from_window(window: np.ndarray, options: SampleOptions | None = None,
                       eod: int | None = None, pad: int | None = None) -> dict[str, torch.Tensor]:
    """A sample from ``seq_length + 1`` consecutive tokens: labels are the tokens shifted by one.

    Without options: loss mask all ones and positions ``0..seq-1`` (Megatron's defaults). Labels
    equal to ``pad`` are masked out of the loss and pad ids become 0, as in Megatron-Core.
    """
    window = np.asarray(window).astype(np.int64)
    tokens, labels = window[:-1], window[1:]
    seq_length = len(tokens)
    loss_mask = np.ones(seq_length, dtype=np.float32)
    position_ids = np.arange(seq_length, dtype=np.int64)
    sample = {}
    if options is not None and eod is not None:
        if options.eod_mask_loss:
            loss_mask[tokens == eod] = 0.0
        if options.reset_position_ids or options.reset_attention_mask:
            numbers = document_numbers(tokens, eod)
            if options.reset_position_ids:
                starts = np.flatnonzero(np.diff(numbers, prepend=-1))  # first token of each
                position_ids -= starts[numbers - numbers[0]]
            if options.reset_attention_mask:
                sample["attention_mask"] = torch.from_numpy(numbers)
    if pad is not None and pad >= 0:
        loss_mask[labels == pad] = 0.0
        tokens, labels = np.where(tokens == pad, 0, tokens), np.where(labels == pad, 0, labels)
    return {"tokens": torch.from_numpy(np.ascontiguousarray(tokens)),
            "labels": torch.from_numpy(np.ascontiguousarray(labels)),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids), **sample}
