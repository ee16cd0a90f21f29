"""A tiny Hugging Face tokenizer built in the test, so no test ever downloads one."""

from __future__ import annotations

from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog hello world plugtron trains on "
         "megatron data a b c d e").split()


def save_tiny_hf_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer: ``<unk>`` 0, ``</s>`` 1 (eos), ``<pad>`` 2, then ``WORDS``;
    written with ``save_pretrained`` into ``folder`` (which is returned)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                        eos_token="</s>", pad_token="<pad>")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return folder
