"""``plugtron data preprocess``: text to Megatron's ``.bin/.idx``, like Megatron's
tools/preprocess_data.py.

Inputs are JSONL files (one JSON object per line; ``--json-keys`` names the fields to tokenize,
each into its own corpus ``PREFIX_KEY_document``), plain text files (each file is one document,
field ``text``) and folders of either. Worker processes tokenize; the main process writes in
input order, so the output does not depend on ``--workers``. Files appear under their final name
only when complete. A line that is not valid JSON, not an object, or lacks a key is reported with
its file and line number and either stops the run (default) or is skipped (``--skip-bad-lines``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from plugtron.api import ConfigError, Tokenizer, build_tokenizer
from tqdm import tqdm

from .indexed_format import IndexedWriter, bin_path, idx_path, optimal_dtype
from .text import TEXT_SUFFIXES, corpus_files

JSON_SUFFIXES = frozenset({".jsonl", ".json"})
#: Records handed to a worker at a time: large enough to amortise the transfer.
CHUNK_SIZE = 64
#: Bad lines printed one by one before only the count is kept.
MAX_REPORTED = 20

_tokenizer: Tokenizer | None = None  # one per worker process


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    bytes_in: int = 0
    seconds: float = 0.0
    bad_lines: list = field(default_factory=list)
    blank_lines: int = 0
    outputs: list = field(default_factory=list)

    def as_dict(self) -> dict:
        seconds = max(self.seconds, 1e-9)
        return {"documents": self.documents, "tokens": self.tokens, "seconds": self.seconds,
                "documents_per_sec": self.documents / seconds,
                "tokens_per_sec": self.tokens / seconds,
                "mb_per_sec": self.bytes_in / seconds / 1e6,
                "bad_lines": len(self.bad_lines), "blank_lines": self.blank_lines,
                "outputs": self.outputs}


def _init_worker(tokenizer_args: tuple) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(*tokenizer_args)


def _worker_tokenizer() -> Tokenizer:
    if _tokenizer is None:
        raise RuntimeError("the preprocessing worker was started without its tokenizer")
    return _tokenizer


def records(paths: Sequence[str]) -> Iterator[tuple]:
    """``(file, line number or 0, JSON line or None)`` for every record of the inputs; a plain
    text file is one record read by the worker."""
    files = []
    for path in paths:
        entry = Path(path).expanduser()
        if entry.is_dir():
            files += corpus_files([str(entry)])
        elif entry.is_file():
            files.append(entry)
        else:
            raise ConfigError(f"--input {path!r} does not exist")
    if not files:
        raise ConfigError(f"no input files in {', '.join(map(repr, paths))} (folders are "
                          f"searched for {', '.join(sorted(TEXT_SUFFIXES))})")
    for file in files:
        if file.suffix.lower() in JSON_SUFFIXES:
            with open(file, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, start=1):
                    yield str(file), number, line
        else:
            yield str(file), 0, None


def encode(record: tuple, json_keys: Sequence[str], append_eod: bool):
    """``(file, line, {key: ids}, bytes, error)`` for one record, in a worker."""
    file, number, line = record
    if line is None:
        try:
            data = Path(file).read_bytes()
        except OSError as exc:
            return file, number, None, 0, f"cannot read: {exc}"
        if b"\0" in data:
            return file, number, None, 0, "binary file (NUL bytes)"
        texts = {key: data.decode("utf-8", errors="replace") for key in json_keys[:1]}
        size = len(data)
    else:
        size = len(line.encode("utf-8"))
        if not line.strip():
            return file, number, None, size, ""  # blank: counted, not an error
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            return file, number, None, size, f"not valid JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(obj, dict):
            return file, number, None, size, f"a JSON {type(obj).__name__}, not an object"
        missing = [key for key in json_keys if not isinstance(obj.get(key), str)]
        if missing:
            return file, number, None, size, f"no string field {missing[0]!r}"
        texts = {key: obj[key] for key in json_keys}
    out = {}
    tokenizer = _worker_tokenizer()
    for key, text in texts.items():
        ids = tokenizer.tokenize(text)
        # Megatron appends eod only to a document that has tokens.
        if append_eod and len(ids):
            ids = [*ids, tokenizer.eod]
        out[key] = ids
    return file, number, out, size, None


def _encode_chunk(chunk, json_keys, append_eod):
    return [encode(record, json_keys, append_eod) for record in chunk]


def _chunks(iterator, size):
    chunk = []
    for item in iterator:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _worker_context():
    """Forked from a clean server process, not from this one: a fork of a process that has
    threads (a notebook, a test runner, a W&B service) can copy a held lock and hang."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_type: str,
               tokenizer_model: str | None = None, vocab_size: int | None = None,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               skip_bad_lines: bool = False, progress: bool = True, log=print) -> Summary:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` per json key."""
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    tokenizer_args = (tokenizer_type, tokenizer_model, vocab_size)
    _init_worker(tokenizer_args)  # fails here, once, on a bad tokenizer
    dtype = optimal_dtype(_worker_tokenizer().vocab_size)
    finals = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    temps = {key: f"{final}.tmp{os.getpid()}" for key, final in finals.items()}
    writers = {key: IndexedWriter(temps[key], dtype) for key in json_keys}
    summary = Summary()
    bar = _progress_bar(progress)
    start = time.perf_counter()
    pool = None
    try:
        chunks = _chunks(records(inputs), CHUNK_SIZE)
        if workers == 1:
            results = (_encode_chunk(chunk, json_keys, append_eod) for chunk in chunks)
        else:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            pool = _worker_context().Pool(workers, _init_worker, (tokenizer_args,))
            results = pool.imap(_Encoder(json_keys, append_eod), chunks)
        for chunk in results:
            for file, number, ids, size, error in chunk:
                summary.bytes_in += size
                if error == "":
                    summary.blank_lines += 1
                    continue
                if error is not None:
                    where = f"{file}:{number}" if number else file
                    if not skip_bad_lines:
                        raise ConfigError(f"{where}: {error}; fix the line or pass "
                                          f"--skip-bad-lines to skip such lines")
                    summary.bad_lines.append(f"{where}: {error}")
                    if len(summary.bad_lines) <= MAX_REPORTED:
                        log(f"skipped {where}: {error}")
                    continue
                for key, token_ids in ids.items():
                    if len(token_ids):
                        writers[key].add_document(token_ids)
                    else:
                        writers[key].end_document()  # an empty document, as Megatron keeps it
                    summary.tokens += len(token_ids)
                summary.documents += 1
            if bar is not None:
                bar.update(len(chunk))
                bar.set_postfix(docs=summary.documents, tokens=summary.tokens, refresh=False)
        for key, writer in writers.items():
            writer.finalize()
            os.replace(bin_path(temps[key]), bin_path(finals[key]))
            os.replace(idx_path(temps[key]), idx_path(finals[key]))
            summary.outputs.append(finals[key])
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
        for key, writer in writers.items():
            writer._bin.close()
            for path in (bin_path(temps[key]), idx_path(temps[key])):
                if os.path.exists(path):
                    os.remove(path)
    summary.seconds = time.perf_counter() - start
    if len(summary.bad_lines) > MAX_REPORTED:
        log(f"... and {len(summary.bad_lines) - MAX_REPORTED} more bad lines skipped")
    return summary


class _Encoder:
    """A picklable callable for ``Pool.imap`` (a lambda is not)."""

    def __init__(self, json_keys, append_eod):
        self.json_keys, self.append_eod = tuple(json_keys), append_eod

    def __call__(self, chunk):
        return _encode_chunk(chunk, self.json_keys, self.append_eod)


def _progress_bar(enabled: bool):
    if not enabled:
        return None

    return tqdm(unit=" records", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


def format_summary(summary: Summary) -> str:
    s = summary.as_dict()
    lines = [f"{s['documents']:,} documents, {s['tokens']:,} tokens in {s['seconds']:.2f} s: "
             f"{s['documents_per_sec']:,.0f} documents/s, {s['tokens_per_sec']:,.0f} tokens/s, "
             f"{s['mb_per_sec']:.2f} MB/s"]
    if s["bad_lines"]:
        lines.append(f"{s['bad_lines']} bad lines skipped")
    if s["blank_lines"]:
        lines.append(f"{s['blank_lines']} blank lines ignored")
    lines += [f"wrote {prefix}.bin and {prefix}.idx" for prefix in s["outputs"]]
    return "\n".join(lines)
