"""The run's tokenizer: ``--tokenizer-type`` names an entry point in ``plugtron.tokenizers``.

A tokenizer is an object with ``vocab_size``, ``eod`` (the id that ends a document),
``bos``/``eos``/``pad`` (an id or ``None``), ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str``; its class is built as ``cls(model=--tokenizer-model,
vocab_size=--vocab-size)``. The tokenizer fixes the model's vocabulary: a dataset provider calls
:func:`tokenizer_for` and the chosen name goes into the config, so the checkpoint records it.
"""

from __future__ import annotations

import copy

from plugtron.core.checkpoint.loader import check_tokenizer
from plugtron.core.checkpoint.saved_config import saved_config
from plugtron.core.contracts.tokenizer import Tokenizer
from plugtron.core.errors import ConfigError
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import selected_driver


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_size: int | None = None) -> Tokenizer:
    """An instance of the tokenizer ``tokenizer_type`` (``PluginError`` lists the names)."""
    cls = registry.load("tokenizer", tokenizer_type)
    return cls(model=tokenizer_model, vocab_size=vocab_size)


def tokenizer_for(config, default: str | None = None) -> Tokenizer:
    """The run's tokenizer (``--tokenizer-type``, else ``default``), with the vocabulary fixed.

    Records the chosen type in ``config.data.tokenizer_type`` and sets
    ``config.model.vocab_size`` to the tokenizer's; a ``--vocab-size`` that differs is refused,
    because a model with another vocabulary would train on ids that mean something else.
    """
    data, model = config.data, config.model
    name = data.tokenizer_type or default
    if name is None:
        raise ConfigError(f"--data {selected_driver(config, 'dataset')} needs --tokenizer-type (e.g. "
                          f"HuggingFaceTokenizer --tokenizer-model DIR); "
                          f"{registry.describe_available('tokenizer')}")
    tokenizer = build_tokenizer(name, data.tokenizer_model, model.vocab_size)
    if model.vocab_size is not None and model.vocab_size != tokenizer.vocab_size:
        load = config.checkpoint.load
        source = (f"the vocabulary of {model.vocab_size} that --load's model has (or "
                  f"--vocab-size)" if load else f"--vocab-size {model.vocab_size}")
        advice = ("give the tokenizer that model was trained with (--tokenizer-type, "
                  "--tokenizer-model)" if load else
                  "leave --vocab-size unset (the tokenizer fixes it)")
        raise ConfigError(f"{source} does not match tokenizer {name}'s vocabulary of "
                          f"{tokenizer.vocab_size}; {advice}")
    data.tokenizer_type = name
    model.vocab_size = tokenizer.vocab_size
    return tokenizer


def check_checkpoint_tokenizer(config) -> None:
    """Before launch, with ``--load`` and a named ``--tokenizer-type``: the tokenizer must give
    the checkpoint's vocabulary (``CheckpointError``, exit 2, naming the tokenizer it was
    trained with). Without a named tokenizer the dataset's default is checked in the ranks when
    the checkpoint is loaded."""

    data = config.data
    saved = saved_config(config.checkpoint.load)
    if not saved or not data.tokenizer_type:
        return
    saved_vocab = (saved.get("model") or {}).get("vocab_size")
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model,
                                config.model.vocab_size or saved_vocab)
    probe = copy.deepcopy(config)
    probe.model.vocab_size = tokenizer.vocab_size
    check_tokenizer(saved, probe)
