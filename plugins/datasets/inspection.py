"""What ``plugtron data inspect`` and ``plugtron data stats`` report about a run's datasets.

Plain functions over the datasets a provider returned: the samples themselves (any provider),
and for Megatron corpora (``--data indexed``) the documents, tokens, length histogram and
epochs of each split, and a blend's effective weights over the samples the run draws.
"""

from __future__ import annotations

import numpy as np


def sample_records(dataset, start: int, count: int, tokenizer=None) -> list[dict]:
    """Samples ``start .. start + count - 1`` as plain lists (and text, with a tokenizer)."""
    out = []
    for index in range(start, min(start + count, len(dataset))):
        sample = dataset[index]
        record = {"index": index, **{key: value.tolist() for key, value in sample.items()}}
        if tokenizer is not None:
            record["text"] = tokenizer.detokenize(record["tokens"])
        if "attention_mask" in record:
            record["documents"] = document_views(record, tokenizer)
        out.append(record)
    return out


def document_views(record: dict, tokenizer=None) -> list[dict]:
    """A sample's documents (runs of one number in ``attention_mask``; the whole sample without
    it): positions, inputs and what the loss learns there (the labels with loss), as text when
    a tokenizer is given, else ids."""
    numbers = record.get("attention_mask") or [0] * len(record["tokens"])
    views, start = [], 0
    for end in range(1, len(numbers) + 1):
        if end < len(numbers) and numbers[end] == numbers[start]:
            continue
        inputs = record["tokens"][start:end]
        learned = [label for label, loss in zip(record["labels"][start:end],
                                                record["loss_mask"][start:end]) if loss]
        view = {"positions": [start, end - 1], "loss_tokens": len(learned)}
        if tokenizer is not None:
            view["text"], view["learns"] = tokenizer.detokenize(inputs), \
                tokenizer.detokenize(learned)
        else:
            view["ids"], view["learns"] = inputs, learned
        views.append(view)
        start = end
    return views


def length_histogram(lengths: np.ndarray) -> list[dict]:
    """Document lengths in power-of-two bins ``[lo, hi)``, empty bins left out."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return []
    top = int(lengths.max())
    edges = [0, 1]
    while edges[-1] <= top:
        edges.append(edges[-1] * 2)
    counts, _ = np.histogram(lengths, bins=edges)
    return [{"min": lo, "max": hi - 1, "documents": int(n)}
            for lo, hi, n in zip(edges[:-1], edges[1:], counts) if n]


def _corpus_split(dataset) -> dict:
    begin, end = dataset.description.get("range", [0, 0])
    lengths = np.asarray(dataset.corpus.sequence_lengths[begin:end])
    seq = dataset.description.get("seq_length")
    return {"corpus": dataset.corpus.prefix, "documents": int(end - begin),
            "tokens": int(lengths.sum(dtype=np.int64)), "epochs": dataset.num_epochs,
            "samples_built": len(dataset),
            "samples_per_epoch": int((lengths.sum(dtype=np.int64) - 1) // seq) if seq else None,
            "length_histogram": length_histogram(lengths),
            "mean_length": float(lengths.mean()) if len(lengths) else 0.0}


def _records_split(dataset) -> dict:
    """A packed instruction-data split (``--data sft``): its records, sequences, packing."""
    lengths = np.asarray([len(d.tokens) for d in dataset.documents])
    return {"corpus": dataset.files, "records": len(dataset.documents),
            "sequences": len(dataset.packs), "packing_efficiency": float(dataset.efficiency),
            "samples_built": len(dataset), "length_histogram": length_histogram(lengths),
            "mean_length": float(lengths.mean()) if len(lengths) else 0.0}


def _part_stats(dataset) -> dict:
    if hasattr(dataset, "corpus"):
        return _corpus_split(dataset)
    if hasattr(dataset, "efficiency"):
        return _records_split(dataset)
    return {}


def split_stats(dataset, needed: int) -> dict:
    """One split: the samples the run draws (``needed``) and what they come from."""
    if dataset is None:
        return {"samples": 0, "needed": needed}
    out: dict[str, object] = {"samples": len(dataset), "needed": needed}
    if hasattr(dataset, "dataset_index"):  # a blend
        drawn = np.asarray(dataset.dataset_index[:min(needed, len(dataset))])
        counts = np.bincount(drawn, minlength=len(dataset.datasets))
        out["blend"] = [{"weight": float(w),
                         "effective_weight": float(n / max(1, len(drawn))),
                         "samples_drawn": int(n), **_part_stats(part)}
                        for w, n, part in zip(dataset.weights, counts, dataset.datasets)]
    else:
        out.update(_part_stats(dataset))
    return out


def format_stats(stats: dict) -> str:
    lines = [f"data {stats['data']}: seq_length {stats['seq_length']}"]
    for split, entry in stats["splits"].items():
        if entry["samples"] == 0:
            lines.append(f"{split}: empty (no documents in --split, or not drawn)")
            continue
        lines.append(f"{split}: {entry['samples']} samples built, the run draws "
                     f"{entry['needed']}")
        parts = entry.get("blend") or ([entry] if "corpus" in entry else [])
        for part in parts:
            weight = ""
            if "weight" in part:
                weight = (f"weight {part['weight']:.4f} (effective "
                          f"{part['effective_weight']:.4f}, {part['samples_drawn']} drawn), ")
            if "records" in part:
                lines.append(f"  {part['corpus']}: {weight}{part['records']} records (mean "
                             f"{part['mean_length']:.1f} tokens) in {part['sequences']} "
                             f"sequences, packing efficiency {part['packing_efficiency']:.1%}")
            else:
                lines.append(f"  {part['corpus']}: {weight}{part['documents']} documents, "
                             f"{part['tokens']} tokens (mean {part['mean_length']:.1f}), "
                             f"{part['epochs']} epoch(s) of {part['samples_per_epoch']} "
                             f"samples")
            for row in part["length_histogram"]:
                lines.append(f"    length {row['min']:>7}-{row['max']:<7} "
                             f"{row['documents']} documents")
    return "\n".join(lines)
