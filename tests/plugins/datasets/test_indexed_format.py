"""Megatron's .bin/.idx format: a corpus written byte by byte from the format description reads
back exactly; plugtron's writer produces those same bytes; Megatron-Core reads plugtron's files
and plugtron reads Megatron-Core's (when megatron-core is installed)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from plugtron.plugins.datasets.indexed_format import (
    IndexedCorpus,
    IndexedFormatError,
    IndexedWriter,
    optimal_dtype,
)

DOCUMENTS = [[5, 6, 7], [8], [], [9, 10, 11, 12, 65000]]


def write_by_hand(prefix, documents, dtype_code=8, itemsize=2, fmt="<H"):
    """The format description, literally: header, lengths, pointers, document indices."""
    with open(f"{prefix}.bin", "wb") as f:
        for document in documents:
            for token in document:
                f.write(struct.pack(fmt, token))
    lengths = [len(d) for d in documents]
    pointers, position = [], 0
    for length in lengths:
        pointers.append(position)
        position += length * itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(documents) + 1))
        for length in lengths:
            f.write(struct.pack("<i", length))
        for pointer in pointers:
            f.write(struct.pack("<q", pointer))
        for count in range(len(documents) + 1):
            f.write(struct.pack("<q", count))


def test_a_corpus_written_byte_by_byte_reads_back(tmp_path):
    write_by_hand(tmp_path / "hand", DOCUMENTS)
    corpus = IndexedCorpus(tmp_path / "hand")
    assert corpus.dtype == np.uint16 and len(corpus) == 4 and corpus.num_documents == 4
    assert [corpus[i].tolist() for i in range(4)] == DOCUMENTS
    assert corpus.sequence_lengths.tolist() == [3, 1, 0, 5]
    assert corpus.sequence_pointers.tolist() == [0, 6, 8, 8]
    assert corpus.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert corpus.get(3, offset=1, length=2).tolist() == [10, 11]
    assert corpus.get(3, offset=2).tolist() == [11, 12, 65000]
    assert corpus.document(0).tolist() == [5, 6, 7] and corpus.num_tokens == 9
    assert isinstance(corpus.tokens, np.memmap), "tokens are mapped, not loaded"


@pytest.mark.parametrize("dtype,code,fmt", [(np.uint16, 8, "<H"), (np.int32, 4, "<i"),
                                            (np.int64, 5, "<q"), (np.uint8, 1, "<B")])
def test_the_writer_writes_exactly_those_bytes(tmp_path, dtype, code, fmt):
    documents = [[t % 250 for t in d] for d in DOCUMENTS]
    write_by_hand(tmp_path / "hand", documents, code, np.dtype(dtype).itemsize, fmt)
    with IndexedWriter(tmp_path / "ours", dtype) as writer:
        for document in documents:
            writer.add_document(document)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == \
            (tmp_path / f"hand{suffix}").read_bytes(), suffix


def test_documents_of_several_sequences(tmp_path):
    with IndexedWriter(tmp_path / "multi", np.int32) as writer:
        writer.add_item([1, 2])
        writer.add_item([3])
        writer.end_document()
        writer.add_document([4, 5, 6], lengths=[1, 2])
    corpus = IndexedCorpus(tmp_path / "multi")
    assert corpus.document_indices.tolist() == [0, 2, 4]
    assert corpus.document(0).tolist() == [1, 2, 3] and corpus.document(1).tolist() == [4, 5, 6]
    assert corpus[3].tolist() == [5, 6]


def test_broken_files_are_named(tmp_path):
    write_by_hand(tmp_path / "c", DOCUMENTS)
    data = bytearray((tmp_path / "c.idx").read_bytes())
    (tmp_path / "bad.bin").write_bytes((tmp_path / "c.bin").read_bytes())
    for mutate, message in ((lambda d: d.__setitem__(0, ord("X")), "bad magic"),
                            (lambda d: d.__setitem__(17, 99), "unknown dtype code 99"),
                            (lambda d: d.__setitem__(9, 2), "version 2"),
                            (lambda d: d.__delitem__(slice(-8, None)), "need")):
        broken = bytearray(data)
        mutate(broken)
        (tmp_path / "bad.idx").write_bytes(bytes(broken))
        with pytest.raises(IndexedFormatError, match=message):
            IndexedCorpus(tmp_path / "bad")
    (tmp_path / "short.idx").write_bytes(bytes(data))
    (tmp_path / "short.bin").write_bytes(b"\x00\x00")
    with pytest.raises(IndexedFormatError, match="needs 18"):
        IndexedCorpus(tmp_path / "short")
    with pytest.raises(FileNotFoundError, match="nothing.idx"):
        IndexedCorpus(tmp_path / "nothing")


def test_megatrons_dtype_rule():
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def test_megatron_core_reads_ours_and_we_read_theirs(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 60000, size=rng.integers(0, 50)).tolist() for _ in range(30)]
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_item(torch.tensor(document, dtype=torch.int64))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    with IndexedWriter(tmp_path / "ours", np.uint16) as writer:
        for document in documents:
            writer.add_document(document)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == \
            (tmp_path / f"theirs{suffix}").read_bytes()
    theirs = indexed.IndexedDataset(str(tmp_path / "ours"))
    ours = IndexedCorpus(tmp_path / "theirs")
    assert len(theirs) == len(ours) == 30
    for i, document in enumerate(documents):
        assert theirs[i].tolist() == ours[i].tolist() == document
    assert theirs.document_indices.tolist() == ours.document_indices.tolist()
    assert theirs.get(5, offset=1, length=2).tolist() == ours.get(5, offset=1, length=2).tolist()
