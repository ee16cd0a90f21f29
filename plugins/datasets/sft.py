"""``--data sft --data-path FILE.jsonl``: instruction data, packed.

Records (sft_records.py) become documents with a loss on the answers only. They are split by
``--split`` (shuffled with ``--seed``), and each split's documents are packed into sequences of
``--seq-length`` (sft_packing.py: first-fit decreasing within windows of
``--sft-packing-window`` documents, or in order), each position knowing its document, so the
attention keeps them apart and positions restart per document. ``--no-sft-packing`` gives one
document per (padded) sequence. Sample ``i`` is pack ``perm_e[i % n]`` of epoch ``e = i // n``
(the permutation seeded by seed, split and epoch): any rank computes it alone, a resumed run
reads what the uninterrupted run read, and the data repeats for as many epochs as the run asks.

Several files are one pool of records (``--data-path A.jsonl B.jsonl``), or a blend with weights
(``--data-path 0.3 A.jsonl 0.7 B.jsonl``, Megatron's form): then each file is split and packed on
its own and the split's samples are drawn from the files by Megatron's greedy blending rule (the
pretraining blend's: each file's share of every prefix of the samples as close to its weight as
can be), each file repeating for as many epochs as its share needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from plugtron.api import (
    SAMPLE_SECTION,
    ConfigError,
    ConfigSection,
    hookimpl,
    opt,
    tokenizer_for,
    validate_sample_options,
)

from .common import parse_split, seeded_rng, split_documents, tokenizer_vocab_size
from .gpt_dataset import BlendedIndexedDataset
from .gpt_indices import blend_sizes, build_blending_indices
from .indexed import parse_blend
from .sft_packing import ORDERS, efficiency, pack, packed_sample
from .sft_records import Document, read_records, render

_SPLIT_TAG, _EPOCH_TAG = 404, 405
TOO_LONG = ("truncate", "drop")


@dataclass
class SFTOptions:
    sft_packing: bool = opt(True, "--sft-packing", "Pack several records into each sequence "
                            "(attention and positions kept per record).", is_flag=True,
                            negative="--no-sft-packing")
    sft_packing_order: str = opt("ffd", "--sft-packing-order", "ffd: first-fit decreasing "
                                 "within each window of records; in-order: fill sequences in "
                                 "the records' (shuffled) order.", choices=ORDERS)
    sft_packing_window: int = opt(1000, "--sft-packing-window",
                                  "Records sorted and packed together by ffd.")
    sft_loss_on_prompt: bool = opt(False, "--sft-loss-on-prompt", "The loss counts the prompt "
                                   "(user and system turns) too, not only the answers.",
                                   is_flag=True)
    sft_prompt_template: str = opt("{prompt}\n", "--sft-prompt-template",
                                   "How a 'prompt' record's prompt is written before its "
                                   "response; must contain {prompt}.")
    sft_pad_to_multiple_of: int = opt(1, "--sft-pad-to-multiple-of",
                                      "Pad each packed record to a multiple of N positions. "
                                      "2 x cp lets context parallelism cut every record in "
                                      "2 x cp parts, which balances its attention work.")
    sft_too_long: str = opt("truncate", "--sft-too-long", "A record longer than --seq-length "
                            "+ 1 tokens: truncated, or dropped (both counted).", choices=TOO_LONG)


SFT_SECTION = ConfigSection("sft", SFTOptions, title="Instruction data (--data sft)")


class SFTDataset:
    """Map-style dataset of packed (or single) documents; see the module docstring."""

    def __init__(self, documents: list[Document], packs: list[list[int]], seq_length: int,
                 num_samples: int, seed: int, split_index: int, document_ids: bool,
                 multiple: int = 1, source: tuple[int, ...] = ()):
        self.documents, self.packs, self.seq_length = documents, packs, seq_length
        self.multiple, self.source = multiple, source  # source: the blend's file, if any
        self.seed, self.split_index, self.document_ids = seed, split_index, document_ids
        epochs = max(1, -(-num_samples // len(packs)))
        self.length = epochs * len(packs)
        self._epoch: tuple[int, np.ndarray] | None = None
        lengths = [len(d.tokens) for d in documents]
        self.efficiency = efficiency(lengths, packs, seq_length)
        self.files = ""  # where the records came from (data stats)
        self.summary = (f"{len(documents)} records in {len(packs)} sequences, packing "
                        f"efficiency {self.efficiency:.1%}")

    def __len__(self) -> int:
        return self.length

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = seeded_rng(self.seed, _EPOCH_TAG, self.split_index, epoch, *self.source)
            self._epoch = (epoch, rng.permutation(len(self.packs)))
        return self._epoch[1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        epoch, slot = divmod(int(index), len(self.packs))
        chosen = self.packs[int(self._order(epoch)[slot])]
        return packed_sample([(self.documents[i].tokens, self.documents[i].targets)
                              for i in chosen], self.seq_length, self.document_ids,
                             self.multiple)


def _data_paths(config) -> tuple[list[str], list[float] | None]:
    """The files and, for a blend, their weights (normalised)."""
    paths = config.data.data_path or []
    values = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
    files, weights = parse_blend(values)
    if weights is None:
        return values, None
    return files, [w / sum(weights) for w in weights]


def _fit(document: Document, seq_length: int, too_long: str) -> Document | None:
    """The document within ``seq_length + 1`` tokens (truncated), or None to drop it."""
    cap = seq_length + 1
    if len(document.tokens) > cap:
        if too_long == "drop":
            return None
        document = Document(document.tokens[:cap], document.targets[:cap], document.where)
    return document if document.targets[1:].any() else None


def _say(text: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"sft: {text}", flush=True)


class SFTPlugin:
    """Dataset provider ``sft`` (entry point in ``plugtron.datasets``)."""

    default_tokenizer = "ByteTokenizer"
    #: The last run's tokenizer (``plugtron data inspect`` shows text with it).
    tokenizer = None

    @staticmethod
    def packs_documents(config) -> str | None:
        """The contract's question (plugtron.api.documents_masked): do samples carry several
        documents? Models and backends that cannot keep them apart then refuse the run."""
        options = getattr(config, "sft", None)
        if options is not None and options.sft_packing:
            return "--data sft with packing (--no-sft-packing: one record per sequence)"
        return None

    @hookimpl
    def plugtron_config_sections(self):
        return [SFT_SECTION, SAMPLE_SECTION]

    @hookimpl
    def plugtron_validate(self, config):
        options = config.sft
        paths, _ = _data_paths(config)
        if not paths:
            raise ConfigError("--data sft needs --data-path FILE (a .jsonl file of records; "
                              "docs/data.md, 'Instruction data')")
        for path in paths:
            if not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(f"--data-path {path!r} is not a file (give a .jsonl file of "
                                  f"records, or .parquet with pyarrow installed)")
        try:
            options.sft_prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError):
            raise ConfigError(f"--sft-prompt-template {options.sft_prompt_template!r} may hold "
                              f"only {{prompt}} (write braces as {{{{ and }}}})") from None
        if "{prompt}" not in options.sft_prompt_template:
            raise ConfigError(f"--sft-prompt-template {options.sft_prompt_template!r} must "
                              f"contain {{prompt}}")
        if options.sft_packing_window < 1:
            raise ConfigError(f"--sft-packing-window must be at least 1, got "
                              f"{options.sft_packing_window}")
        multiple, seq_length = options.sft_pad_to_multiple_of, config.model.seq_length
        if multiple < 1 or seq_length % multiple:
            raise ConfigError(f"--sft-pad-to-multiple-of {multiple} must be a positive divisor "
                              f"of --seq-length {seq_length} (a packed sequence is filled with "
                              f"padded records)")
        samples = getattr(config, "samples", None)
        if samples is not None and (samples.reset_attention_mask or samples.reset_position_ids
                                    or samples.eod_mask_loss):
            raise ConfigError("--data sft keeps documents apart itself (packing); "
                              "--reset-attention-mask, --reset-position-ids and --eod-mask-loss "
                              "are for token streams (--data text, indexed, mock)")
        validate_sample_options(config)

    @hookimpl
    def dataset_vocab_size(self, config):
        return tokenizer_vocab_size(config, self.default_tokenizer)

    @hookimpl
    def dataset_provider(self, config, split_sizes):
        options, seq_length = config.sft, config.model.seq_length
        tokenizer = self.tokenizer = tokenizer_for(config, default=self.default_tokenizer)
        paths, weights = _data_paths(config)
        sources = [paths] if weights is None else [[path] for path in paths]
        said: list[str] = []
        per_source = []
        for number, files in enumerate(sources):
            documents, note = _read_documents(files, tokenizer, options, seq_length)
            tag = () if weights is None else (number,)
            splits = split_documents(len(documents), parse_split(config.data.split),
                                     seeded_rng(config.training.seed, _SPLIT_TAG, *tag))
            # a blend's file is asked one sample more than its share: the greedy rule may
            # take one more than ceil(size x weight) of a file
            sizes = (split_sizes if weights is None else
                     [blend_sizes([weights[number]], max(0, size))[0] + 1
                      for size in split_sizes])
            built = [_split_dataset([documents[i] for i in indices], num_samples, options,
                                    seq_length, config.training.seed, split_index, tag)
                     for split_index, (num_samples, indices) in enumerate(zip(sizes, splits))]
            for dataset in built:
                if dataset is not None:
                    dataset.files = ", ".join(files)
            per_source.append(built)
            said.append("; ".join([note, *(f"{('train', 'valid', 'test')[i]} {d.summary}"
                                           for i, d in enumerate(built) if d is not None)]))
        _say(said[0] if weights is None else "blend of " + " | ".join(
            f"{w:.3g} x {p}: {t}" for w, p, t in zip(weights, paths, said)))
        if weights is None:
            return tuple(per_source[0])
        return tuple(_blend([built[i] for built in per_source], weights, size)
                     for i, size in enumerate(split_sizes))


def _read_documents(files: list[str], tokenizer, options, seq_length: int):
    """The records of ``files`` as documents that fit, and what was truncated or dropped."""
    documents: list[Document] = []
    truncated = dropped = 0
    for path in files:
        for where, record in read_records(path):
            document = render(record, where, tokenizer, options.sft_prompt_template,
                              options.sft_loss_on_prompt)
            fitted = _fit(document, seq_length, options.sft_too_long)
            if fitted is None:
                dropped += 1
                continue
            truncated += len(fitted.tokens) < len(document.tokens)
            documents.append(fitted)
    if not documents:
        raise ConfigError(f"--data sft: no record of {files} is left with a token to learn "
                          f"({dropped} dropped as longer than --seq-length {seq_length} + 1 or "
                          f"without loss tokens)")
    return documents, f"{len(documents)} records ({truncated} truncated, {dropped} dropped)"


def _split_dataset(documents: list[Document], num_samples: int, options, seq_length: int,
                   seed: int, split_index: int, source: tuple[int, ...]) -> SFTDataset | None:
    if num_samples <= 0 or not documents:
        return None
    if options.sft_packing:
        packs = pack([len(d.tokens) for d in documents], seq_length, options.sft_packing_order,
                     options.sft_packing_window, options.sft_pad_to_multiple_of)
    else:
        packs = [[i] for i in range(len(documents))]
    return SFTDataset(documents, packs, seq_length, num_samples, seed, split_index,
                      document_ids=options.sft_packing, multiple=options.sft_pad_to_multiple_of,
                      source=source)


def _blend(datasets: list[SFTDataset | None], weights: list[float], size: int):
    """The split's samples drawn from the files by Megatron's greedy rule, or None."""
    if size <= 0 or all(d is None for d in datasets):
        return None
    missing = [i for i, (d, w) in enumerate(zip(datasets, weights)) if d is None and w > 0]
    if missing:
        raise ConfigError(f"--data-path blend: file {missing[0] + 1} has no record for a split "
                          f"the run draws from (give it more records, or weight 0)")
    dataset_index, sample_index = build_blending_indices(weights, size)
    return BlendedIndexedDataset(datasets, {"dataset_index": dataset_index,
                                            "dataset_sample_index": sample_index}, weights)
