"""``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH``: a local HF tokenizer.

PATH is a tokenizer directory (``tokenizer.json`` / ``tokenizer_config.json``, as
``save_pretrained`` writes it) or a single ``tokenizer.json`` file. Nothing is downloaded: a
name that is not a local path is refused, so a run never depends on the hub being reachable.
Like Megatron's ``_HuggingFaceTokenizer``, the vocabulary is ``len(tokenizer)`` (added tokens
included) and the end-of-document id is the tokenizer's eos id.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from plugtron.api import ConfigError

#: eos spellings looked for when a bare ``tokenizer.json`` comes without its config.
EOS_SPELLINGS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


def _load(path: Path):
    try:
        import transformers  # noqa: PLC0415 - optional: only this tokenizer needs transformers
    except ImportError:
        raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs the transformers "
                          "package: pip install transformers") from None
    if path.is_file():
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        # A lone tokenizer.json does not say which token is eos: take the usual spellings.
        vocab = tokenizer.get_vocab()
        for name in EOS_SPELLINGS:
            if tokenizer.eos_token is None and name in vocab:
                tokenizer.eos_token = name
        return tokenizer
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class HuggingFaceTokenizer:
    def __init__(self, model: str | None = None, vocab_size: int | None = None):
        if not model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                              "(a local tokenizer directory or tokenizer.json file)")
        path = Path(model).expanduser()
        if not path.exists():
            raise ConfigError(f"--tokenizer-model {model!r} is not a local file or directory "
                              f"(plugtron never downloads tokenizers: save one with "
                              f"tokenizer.save_pretrained(DIR) and pass DIR)")
        try:
            self._tokenizer = _load(path)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer folder is the user's
            raise ConfigError(f"--tokenizer-model {model!r} could not be loaded: "
                              f"{type(exc).__name__}: {exc}") from None
        self.model = str(path.resolve())
        self.vocab_size = len(self._tokenizer)
        self.bos = self._tokenizer.bos_token_id
        self.eos = self._tokenizer.eos_token_id
        self.pad = self._tokenizer.pad_token_id
        if self.eos is None:
            raise ConfigError(f"--tokenizer-model {model!r} has no eos token, which plugtron "
                              f"(like Megatron) uses to end documents")
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer(text).input_ids)

    def detokenize(self, ids: Iterable[int]) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        """The conversation's ids in the tokenizer's chat template (transformers'
        ``apply_chat_template``; newer versions hand back a mapping with ``input_ids``)."""
        out = self._tokenizer.apply_chat_template(messages, tokenize=True,
                                                  add_generation_prompt=add_generation_prompt)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def save(self, directory: str) -> None:
        """Write the tokenizer files (for an HF export next to the weights)."""
        self._tokenizer.save_pretrained(directory)
