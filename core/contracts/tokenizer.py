"""What a tokenizer plugin (group ``plugtron.tokenizers``) is: the members the core, the
built-in datasets, ``plugtron data preprocess`` and ``plugtron generate`` use. Its class is
built as ``cls(model=--tokenizer-model, vocab_size=--vocab-size)``.

Optional, for chat data (``--data sft`` with ``messages``): ``render_chat(messages,
add_generation_prompt=False) -> list[int]``, the ids of a conversation (a list of ``{"role",
"content"}`` dicts) in the tokenizer's own chat template, and ``has_chat_template`` (bool). A
tokenizer without them cannot render conversations, and chat data is refused with it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    #: Size of the vocabulary (the model's ``--vocab-size`` before Megatron's padding).
    vocab_size: int
    #: The id that ends a document (appended by ``data preprocess``; ``--eod-mask-loss``).
    eod: int
    #: Special ids, or None where the tokenizer has none.
    bos: int | None
    eos: int | None
    pad: int | None

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text`` (no eod appended)."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""
        ...
