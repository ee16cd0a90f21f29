"""Megatron-Core's indexed corpus format: a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

``.idx``, little endian::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        dtype code of the tokens (DTYPE_CODES)
    u64       sequence count S
    u64       document count D (documents + 1)
    S x i32   sequence lengths, in tokens
    S x i64   sequence pointers: byte offset of each sequence in .bin
    D x i64   document indices: cumulative sequence counts, starting at 0
    (S x i8   sequence modes, multimodal corpora only; read past, not used)

``.bin`` is the tokens of every sequence back to back in that dtype. For GPT data one document
is one sequence. Reading maps both files (``numpy.memmap``): nothing is loaded or unpickled,
and a sample reads only its own bytes.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: Megatron-Core's DType enum: code -> numpy dtype.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes before the arrays


class IndexedFormatError(ValueError):
    """A file that is not a valid Megatron indexed corpus (the message says why)."""


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's rule: uint16 when the vocabulary is below 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


def exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


# --------------------------------------------------------------------------- writing


class IndexedWriter:
    """Writes a corpus as it comes: tokens go straight to ``.bin``; the index (a few bytes per
    document) is kept in compact arrays and written by :meth:`finalize`.

    ``add_document(tokens)`` is one document of one sequence (the GPT case);
    ``add_item`` + ``end_document`` build documents of several sequences, as Megatron's
    IndexedDatasetBuilder does.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(bin_path(self.prefix), "wb")
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])
        self.num_tokens = 0

    def add_item(self, tokens) -> None:
        data = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(data.tobytes(order="C"))
        self.sequence_lengths.append(data.size)
        self.num_tokens += data.size

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths=None) -> None:
        """One document: ``tokens`` as one sequence, or split into ``lengths``."""
        data = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(data.tobytes(order="C"))
        self.sequence_lengths.extend([data.size] if lengths is None else list(lengths))
        self.num_tokens += data.size
        self.end_document()

    def finalize(self) -> None:
        self._bin.close()
        write_index(idx_path(self.prefix), self.dtype, np.frombuffer(self.sequence_lengths,
                                                                     np.int32),
                    np.frombuffer(self.document_indices, np.int64))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()


def write_index(path: str, dtype, sequence_lengths: np.ndarray,
                document_indices: np.ndarray) -> None:
    """The ``.idx`` file for sequences of these lengths (pointers follow from them)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    documents = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(documents)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(documents.astype("<i8").tobytes())


# --------------------------------------------------------------------------- reading


class IndexedCorpus:
    """A memory-mapped ``.bin/.idx`` pair.

    ``len(corpus)`` is the number of sequences; ``corpus[i]`` is sequence ``i``'s tokens and
    ``corpus.get(i, offset, length)`` part of it (Megatron's ``IndexedDataset.get``), both views
    into the mapped ``.bin``.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        for path in (idx_path(self.prefix), bin_path(self.prefix)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} does not exist (a Megatron corpus is a "
                                        f"PREFIX.bin and PREFIX.idx pair)")
        self._read_index(idx_path(self.prefix))
        bin_size = os.path.getsize(bin_path(self.prefix))
        expected = int(self.sequence_pointers[-1] + self.sequence_lengths[-1].astype(np.int64)
                       * self.dtype.itemsize) if len(self.sequence_lengths) else 0
        if bin_size < expected:
            raise IndexedFormatError(f"{bin_path(self.prefix)} has {bin_size} bytes; its index "
                                     f"needs {expected}")
        self.tokens = (np.memmap(bin_path(self.prefix), dtype=self.dtype, mode="r")
                       if bin_size else np.zeros(0, dtype=self.dtype))

    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[:len(MAGIC)] != MAGIC:
            raise IndexedFormatError(f"{path} is not a Megatron index (bad magic)")
        version, code, sequences, documents = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise IndexedFormatError(f"{path}: index version {version}, only 1 is known")
        if code not in DTYPE_CODES:
            raise IndexedFormatError(f"{path}: unknown dtype code {code}")
        need = HEADER_SIZE + sequences * (4 + 8) + documents * 8
        if size not in (need, need + sequences):  # + one mode byte per sequence: multimodal
            raise IndexedFormatError(f"{path} has {size} bytes; {sequences} sequences and "
                                     f"{documents} document indices need {need}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(path, dtype=np.uint8, mode="r")
        offset = HEADER_SIZE
        self.sequence_lengths = index[offset:offset + 4 * sequences].view("<i4")
        offset += 4 * sequences
        self.sequence_pointers = index[offset:offset + 8 * sequences].view("<i8")
        offset += 8 * sequences
        self.document_indices = index[offset:offset + 8 * documents].view("<i8")

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def _start(self, index: int) -> int:
        return int(self.sequence_pointers[index]) // self.dtype.itemsize

    def __getitem__(self, index: int) -> np.ndarray:
        start = self._start(index)
        return self.tokens[start:start + int(self.sequence_lengths[index])]

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[index]) - offset
        start = self._start(index) + offset
        return self.tokens[start:start + length]

    def document(self, index: int) -> np.ndarray:
        """All tokens of document ``index`` (its sequences are contiguous in ``.bin``)."""
        first, last = int(self.document_indices[index]), int(self.document_indices[index + 1])
        if first == last:
            return self.tokens[:0]
        start = self._start(first)
        end = self._start(last - 1) + int(self.sequence_lengths[last - 1])
        return self.tokens[start:end]
