"""Packing instruction documents into sequences of ``--seq-length``, and the sample of a pack.

A document of ``n`` tokens fills ``n - 1`` positions (its tokens but the last as inputs, all but
the first as labels), so a pack's documents are laid end to end without a token predicting the
next document's first. Each position carries its document's number (``attention_mask``: the
attention keeps documents apart) and its position within the document; the rest of the sequence
is padding, a document of its own without loss. A pack's loss is therefore the sum of its
documents' losses, each computed alone.

``multiple`` (``--sft-pad-to-multiple-of``): each document's positions padded up to a multiple,
the padding part of the document (after its last token, so nothing of the document sees it) and
without loss. ``2 x cp`` lets context parallelism cut every document in ``2 x cp`` parts, which
balances the attention work across the cp ranks (Megatron's THD split).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: How packs are filled: first-fit decreasing within each window of documents, or in order.
ORDERS = ("ffd", "in-order")


def positions(length: int, multiple: int = 1) -> int:
    """Positions a document of ``length`` tokens fills, padded up to a ``multiple``."""
    return -(-(length - 1) // multiple) * multiple


def pack(lengths: Sequence[int], capacity: int, order: str, window: int,
         multiple: int = 1) -> list[list[int]]:
    """Packs of document indices whose (padded) positions add up to at most ``capacity`` each.

    ``ffd``: the documents of each window of ``window`` (in the given order) placed largest
    first into the first pack with room; ``in-order``: a new pack whenever the next document
    does not fit. Both keep every document in exactly one pack; deterministic."""
    packs: list[list[int]] = []
    if order == "in-order":
        room = 0
        for index, length in enumerate(lengths):
            need = positions(length, multiple)
            if not packs or need > room:
                packs.append([])
                room = capacity
            packs[-1].append(index)
            room -= need
        return packs
    for begin in range(0, len(lengths), window):
        chunk = list(range(begin, min(begin + window, len(lengths))))
        chunk.sort(key=lambda i: -positions(lengths[i], multiple))  # stable: ties keep order
        rooms: list[int] = []
        first = len(packs)
        for index in chunk:
            need = positions(lengths[index], multiple)
            slot = next((k for k, room in enumerate(rooms) if room >= need), None)
            if slot is None:
                packs.append([])
                rooms.append(capacity)
                slot = len(rooms) - 1
            packs[first + slot].append(index)
            rooms[slot] -= need
    return packs


def packed_sample(documents: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int,
                  document_ids: bool, multiple: int = 1) -> dict[str, torch.Tensor]:
    """The sample of ``documents`` (``(tokens, targets)`` each) laid end to end and padded.

    ``document_ids``: carry ``attention_mask`` (document numbers); without it (one document per
    sample) causal attention alone keeps the padding after the document out of it."""
    tokens = np.zeros(seq_length, dtype=np.int64)
    labels = np.zeros(seq_length, dtype=np.int64)
    loss = np.zeros(seq_length, dtype=np.float32)
    position_ids = np.zeros(seq_length, dtype=np.int64)
    numbers = np.full(seq_length, len(documents), dtype=np.int64)  # padding: its own document
    at = 0
    for number, (ids, targets) in enumerate(documents):
        n, padded = positions(len(ids)), positions(len(ids), multiple)
        tokens[at:at + n] = ids[:-1]
        labels[at:at + n] = ids[1:]
        loss[at:at + n] = targets[1:]
        position_ids[at:at + padded] = np.arange(padded)
        numbers[at:at + padded] = number
        at += padded
    position_ids[at:] = np.arange(seq_length - at)
    sample = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
              "loss_mask": torch.from_numpy(loss), "position_ids": torch.from_numpy(position_ids)}
    if document_ids:
        sample["attention_mask"] = torch.from_numpy(numbers)
    return sample


def efficiency(lengths: Sequence[int], packs: Sequence[Sequence[int]], seq_length: int) -> float:
    """Positions holding a document, over all positions of the packs."""
    used = sum(positions(lengths[i]) for p in packs for i in p)
    return used / max(1, len(packs) * seq_length)
