"""``--tokenizer-type NullTokenizer``: the text is already token ids, separated by spaces.

For corpora that were tokenized elsewhere and for synthetic data. The vocabulary is
``--vocab-size`` tokens and the end-of-document id is the last one, ``vocab_size - 1``.
Megatron's NullTokenizer instead adds one id for eod on top of ``--vocab-size``; plugtron keeps
``--vocab-size`` as the whole vocabulary so that a saved config reads back to the same model.
"""

from __future__ import annotations

from collections.abc import Iterable

from plugtron.api import ConfigError


class NullTokenizer:
    bos = None
    pad = None

    def __init__(self, model: str | None = None, vocab_size: int | None = None):
        if vocab_size is None or vocab_size < 2:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size (at least 2: "
                              "the last id ends a document)")
        self.model = None
        self.vocab_size = int(vocab_size)
        self.eod = self.eos = self.vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer reads space-separated integer ids") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return " ".join(str(int(i)) for i in ids)
