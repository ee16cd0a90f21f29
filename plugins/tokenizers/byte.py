"""``--tokenizer-type ByteTokenizer``: UTF-8 bytes as tokens, no files needed.

Ids 0..255 are the bytes and 256 ends a document, so the vocabulary is 257. This is what
``--data text`` has always trained on, and what the README's default run uses.
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Bytes as tokens: ``tokenize`` gives the UTF-8 bytes, ``eod`` (256) ends a document."""

    vocab_size = 257
    eod = 256
    bos = None
    eos = 256
    pad = None
    #: How ``detokenize`` shows the end-of-document token.
    eod_text = "<|eod|>"

    def __init__(self, model: str | None = None, vocab_size: int | None = None):
        # Takes (and ignores) the arguments every tokenizer takes: nothing to load.
        self.model = None

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: broken UTF-8 becomes U+FFFD, EOD shows as ``eod_text``, and any id
        past the vocabulary (a padded-vocabulary row a model sampled) as U+FFFD."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        pieces: list[str] = []
        pending = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < 256:
                pending.append(token)
                continue
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            pieces.append(self.eod_text if token == self.eod else "\ufffd")
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    # The names the text dataset used before tokenizers were plugins.
    encode = tokenize
    decode = detokenize
