"""Instruction records for ``--data sft``: read from JSONL (Parquet with pyarrow), checked, and
turned into one document each: its token ids and which of them carry loss.

A record is a chat, ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."},
...]}``, rendered in the tokenizer's own chat template; or a pair, ``{"prompt": "...",
"response": "..."}``, rendered as ``--sft-prompt-template`` (with ``{prompt}``) followed by the
response and the end-of-document id. The loss counts the assistant turns (the tokens the template
adds for each, after the assistant header that ``add_generation_prompt`` writes) or the response
and its end; ``--sft-loss-on-prompt`` counts every token.

Every refusal names the file and line of the record (the row, for Parquet).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from plugtron.api import ConfigError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Document:
    """One record as tokens: ``targets[i]`` says whether token ``i`` is predicted with loss."""

    tokens: np.ndarray  # int64
    targets: np.ndarray  # bool, same length; targets[0] is never used (nothing predicts it)
    where: str  # FILE:LINE of the record


def read_records(path: str) -> Iterator[tuple[str, dict]]:
    """``(FILE:LINE, record)`` for each record of ``path`` (blank lines skipped)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"--data-path {path!r} is not a file (give a .jsonl file of "
                          f"records, or .parquet with pyarrow installed)")
    if file.suffix.lower() == ".parquet":
        yield from _parquet_records(file)
        return
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{file}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column "
                                  f"{exc.colno})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{where}: a record is a JSON object with 'messages', or "
                                  f"'prompt' and 'response'")
            yield where, record


def _parquet_records(file: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional: only Parquet needs it
    except ImportError:
        raise ConfigError(f"--data-path {str(file)!r}: reading Parquet needs pyarrow (pip "
                          f"install pyarrow), or give the records as JSONL") from None
    for number, record in enumerate(pq.read_table(file).to_pylist(), start=1):
        yield f"{file}:row {number}", record


def render(record: dict, where: str, tokenizer, template: str,
           loss_on_prompt: bool) -> Document:
    """The record's document (tokens and loss targets), or a ConfigError naming ``where``."""
    if "messages" in record:
        tokens, targets = _render_chat(record["messages"], where, tokenizer)
    elif "prompt" in record and "response" in record:
        tokens, targets = _render_pair(record, where, tokenizer, template)
    else:
        raise ConfigError(f"{where}: a record needs 'messages' (a chat) or 'prompt' and "
                          f"'response'; it has {sorted(record)}")
    if loss_on_prompt:
        targets = np.ones(len(tokens), dtype=bool)
    return Document(np.asarray(tokens, dtype=np.int64), np.asarray(targets, dtype=bool), where)


def _render_pair(record: dict, where: str, tokenizer, template: str):
    prompt, response = record["prompt"], record["response"]
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ConfigError(f"{where}: 'prompt' and 'response' must be strings")
    head = template.format(prompt=prompt)
    # Tokenized whole and as its head alone: a tokenizer that adds a BOS adds it once, and the
    # response's tokens are those after the head's.
    try:
        before, whole = tokenizer.tokenize(head), tokenizer.tokenize(head + response)
    except Exception as exc:  # noqa: BLE001 - the text is the user's: say which record
        raise ConfigError(f"{where}: the tokenizer refused the text: {exc}") from None
    if whole[:len(before)] != before:
        raise ConfigError(f"{where}: the tokenizer merges the end of the prompt with the "
                          f"response, so the response's tokens cannot be told apart; end "
                          f"--sft-prompt-template with a separator (a newline)")
    tokens = [*whole, tokenizer.eod]
    targets = [False] * len(before) + [True] * (len(tokens) - len(before))
    return tokens, targets


def _render_chat(messages, where: str, tokenizer):
    if not getattr(tokenizer, "has_chat_template", False):
        raise ConfigError(f"{where}: chat records ('messages') need a tokenizer with a chat "
                          f"template (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR "
                          f"whose tokenizer_config has one); this tokenizer has none: give "
                          f"'prompt'/'response' records instead")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{'role', "
                          f"'content'}} objects")
    for turn in messages:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES \
                or not isinstance(turn.get("content"), str):
            role = turn.get("role") if isinstance(turn, dict) else turn
            raise ConfigError(f"{where}: each message is {{'role': one of {', '.join(ROLES)}, "
                              f"'content': text}}; got role {role!r}")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ConfigError(f"{where}: the conversation has no assistant turn, so nothing would "
                          f"be learned from it")
    tokens = _chat(tokenizer, messages, False, where)
    targets = np.zeros(len(tokens), dtype=bool)
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        # The assistant's tokens: what its turn adds after the header a generation starts from.
        head = _chat(tokenizer, messages[:i], True, where) if i else []
        upto = _chat(tokenizer, messages[:i + 1], False, where)
        if tokens[:len(upto)] != upto or upto[:len(head)] != head:
            raise ConfigError(f"{where}: the tokenizer's chat template does not render a "
                              f"conversation as the start of its continuation, so the "
                              f"assistant's tokens cannot be found")
        targets[len(head):len(upto)] = True
    return tokens, targets


def _chat(tokenizer, messages, generation: bool, where: str) -> list[int]:
    try:
        return list(tokenizer.render_chat(messages, add_generation_prompt=generation))
    except Exception as exc:  # noqa: BLE001 - a template's own refusal (a role it does not know)
        raise ConfigError(f"{where}: the chat template refused the conversation: "
                          f"{type(exc).__name__}: {exc}") from None
