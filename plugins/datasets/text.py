"""``--data text``: train on plain text files, tokenized by the run's tokenizer.

Every file is one document, followed by the tokenizer's end-of-document id. The default
tokenizer is ``ByteTokenizer`` (bytes 0..255, eod 256, vocabulary 257), so no tokenizer files are
needed; ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` tokenizes the same files
with a real vocabulary. ``--data-path`` names files or folders; without one, the corpus is the
Python standard library's own source, which is on every machine that runs plugtron and is large
enough (about 12 MB) to train a small model on.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from plugtron.api import (
    SAMPLE_SECTION,
    ConfigError,
    hookimpl,
    tokenizer_for,
    validate_sample_options,
)

from .common import (
    TokenWindowDataset,
    concat_documents,
    parse_split,
    seeded_rng,
    split_documents,
    token_dtype,
    tokenizer_vocab_size,
)

#: Suffixes read when walking a folder; a file named directly is read whatever its suffix.
TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".tex", ".csv", ".tsv", ".json", ".jsonl", ".xml", ".html", ".css",
    ".yaml", ".yml", ".toml", ".cfg", ".ini",
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".java", ".js", ".ts", ".go", ".rs",
    ".sh", ".sql", ".r", ".jl", ".lua", ".rb", ".pl", ".swift", ".kt", ".scala", ".hs",
})
#: Folders never walked into: caches and hidden folders (.git, .venv) are not a user's corpus.
SKIPPED_FOLDERS = frozenset({"__pycache__", "node_modules"})
#: The index caches plugtron's indexed data writes beside a corpus (``PREFIX/cache/...``):
#: they hold descriptions and arrays of another dataset, never text to train on.
INDEX_CACHE_FOLDERS = frozenset({"GPTDataset_indices", "BlendedDataset_indices"})
#: Standard-library folders left out of the default corpus: installed packages and test suites.
STDLIB_SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests",
                                    "idle_test"})

_SHUFFLE_TAG = 303


# --------------------------------------------------------------------------- corpus


def _walk(folder: Path, suffixes: frozenset[str], skipped: frozenset[str]) -> list[Path]:
    """Files under ``folder`` with one of ``suffixes``, in sorted order for determinism."""
    found: list[Path] = []
    for directory, subdirectories, files in os.walk(folder):
        subdirectories[:] = sorted(d for d in subdirectories
                                   if d not in skipped and not d.startswith("."))
        found.extend(Path(directory, name) for name in sorted(files)
                     if Path(name).suffix.lower() in suffixes)
    return found


def refuse_indexed_prefix(entry: str) -> None:
    """A Megatron prefix (PREFIX.bin/.idx beside it) is not text; its index cache is a folder
    of the same name, whose files must never be read as a corpus."""
    path = Path(entry).expanduser()
    if Path(f"{path}.idx").is_file() or Path(f"{path}.bin").is_file():
        raise ConfigError(f"--data-path {entry!r} is a Megatron indexed corpus ({path.name}"
                          f".bin/.idx), which --data text does not read: give --data indexed "
                          f"--tokenizer-type NAME (the tokenizer it was preprocessed with)")


def corpus_files(data_path: Sequence[str]) -> list[Path]:
    """The files of the corpus: the named files, and the text files under the named folders.

    With no ``data_path``, the standard library's ``*.py`` files of the running interpreter.
    """
    if not data_path:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return _walk(stdlib, frozenset({".py"}), SKIPPED_FOLDERS | STDLIB_SKIPPED_FOLDERS)
    files: list[Path] = []
    for entry in data_path:
        path = Path(entry).expanduser()
        refuse_indexed_prefix(entry)
        if path.is_dir():
            found = _walk(path, TEXT_SUFFIXES, SKIPPED_FOLDERS | INDEX_CACHE_FOLDERS)
            if not found:
                raise ConfigError(f"--data-path {entry!r} holds no text files (suffixes "
                                  f"{', '.join(sorted(TEXT_SUFFIXES)[:6])}, ...)")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"--data-path {entry!r} does not exist (give text files or "
                              f"folders of them; a Megatron PREFIX of PREFIX.bin/.idx is read "
                              f"with --data indexed)")
    return files


def read_document(path: Path) -> np.ndarray | None:
    """The file's bytes as tokens, or ``None`` for a file that is empty, unreadable or binary
    (a NUL byte is the usual sign; text files do not contain one)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data or b"\0" in data:
        return None
    return np.frombuffer(data, dtype=np.uint8)


def _describe(data_path: Sequence[str]) -> str:
    if data_path:
        return "--data-path " + " ".join(repr(p) for p in data_path)
    return f"the standard library at {sysconfig.get_paths()['stdlib']!r}"


def tokenize_document(data: np.ndarray, tokenizer) -> np.ndarray:
    """A document's tokens: its bytes under ``ByteTokenizer`` (no decoding needed), else the
    tokenizer's ids for its UTF-8 text (undecodable bytes become U+FFFD)."""
    if getattr(tokenizer, "vocab_size", None) == 257 and getattr(tokenizer, "eod", None) == 256:
        return data
    text = data.tobytes().decode("utf-8", errors="replace")
    return np.asarray(tokenizer.tokenize(text), dtype=token_dtype(tokenizer.vocab_size))


class TextDataset:
    """Dataset provider ``text`` (entry point in ``plugtron.datasets``)."""

    #: The last run's tokenizer (``plugtron data inspect`` shows text with it).
    tokenizer = None
    #: Without --tokenizer-type (``plugtron estimate`` reads it for the vocabulary).
    default_tokenizer = "ByteTokenizer"

    @hookimpl
    def plugtron_validate(self, config):
        validate_sample_options(config)
        for entry in config.data.data_path or []:  # before launch, not in every rank
            refuse_indexed_prefix(entry)

    @hookimpl
    def plugtron_config_sections(self):
        return [SAMPLE_SECTION]

    @hookimpl
    def dataset_vocab_size(self, config):
        return tokenizer_vocab_size(config, self.default_tokenizer)

    @hookimpl
    def dataset_provider(self, config, split_sizes):
        """Build (train, valid, test) from text files, split by documents.

        Documents are shuffled with ``--seed`` and cut by ``--split`` weights, so no file is in
        two splits. A split asked for 0 samples, or left without documents, is ``None``. The
        tokenizer (``--tokenizer-type``, default ``ByteTokenizer``) fixes
        ``config.model.vocab_size``; a different ``--vocab-size`` is an error.
        """
        tokenizer = self.tokenizer = tokenizer_for(config, default=self.default_tokenizer)
        weights = parse_split(config.data.split)
        data_path = config.data.data_path or []
        data_path = [data_path] if isinstance(data_path, (str, os.PathLike)) else list(data_path)
        documents = [tokenize_document(doc, tokenizer)
                     for doc in map(read_document, corpus_files(data_path)) if doc is not None]
        documents = [doc for doc in documents if len(doc)]
        if not documents:
            raise ConfigError(f"no text documents found in {_describe(data_path)} (files must "
                              f"be non-empty text; folders are searched for "
                              f"{', '.join(sorted(TEXT_SUFFIXES))})")
        seed = config.training.seed
        options = getattr(config, "samples", None)
        split_indices = split_documents(len(documents), weights, seeded_rng(seed, _SHUFFLE_TAG))
        datasets = []
        for split_index, (num_samples, indices) in enumerate(zip(split_sizes, split_indices)):
            if num_samples <= 0 or len(indices) == 0:
                datasets.append(None)
                continue
            stream = concat_documents([documents[i] for i in indices], tokenizer.eod,
                                      token_dtype(tokenizer.vocab_size))
            datasets.append(TokenWindowDataset(stream, config.model.seq_length, num_samples,
                                               seed, split_index, options, tokenizer.eod))
        return tuple(datasets)
