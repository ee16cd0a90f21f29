"""Small Megatron corpora for the indexed-data tests, written with plugtron's writer."""

from __future__ import annotations

import numpy as np
from plugtron.plugins.datasets.indexed_format import IndexedWriter

VOCAB = 1000
EOD = VOCAB - 1  # NullTokenizer's eod


def write_corpus(prefix, num_documents=40, seed=0, max_length=60, empty_every=0):
    """Random documents of 0..max_length tokens, each ending with EOD (as --append-eod does);
    every ``empty_every``-th document is empty. Returns the documents."""
    rng = np.random.default_rng(seed)
    documents = []
    with IndexedWriter(prefix, np.uint16) as writer:
        for i in range(num_documents):
            if empty_every and i % empty_every == 0:
                document = []
            else:
                document = [*rng.integers(0, VOCAB - 1, size=rng.integers(1, max_length)), EOD]
            writer.add_document(document)
            documents.append(document)
    return documents
