"""``plugtron data``: prepare corpora in Megatron's ``.bin/.idx`` format.

The work is done by the ``indexed`` dataset plugin (loaded through the registry, as a run loads
it); this module only parses flags and prints.
"""

from __future__ import annotations

import json

import click
from plugtron.core import registry

from .errors import user_errors


@click.group()
def data():
    """Prepare and look at training data."""


@data.command()
@click.option("--input", "inputs", multiple=True, required=True,
              help="JSONL file, text file or folder (repeatable).")
@click.option("--json-keys", multiple=True, default=("text",), show_default=True,
              help="JSON fields to tokenize, each into its own corpus (repeatable).")
@click.option("--tokenizer-type", required=True,
              help="ByteTokenizer, NullTokenizer, HuggingFaceTokenizer (plugtron.tokenizers).")
@click.option("--tokenizer-model", default=None, help="Local tokenizer directory or file.")
@click.option("--vocab-size", type=int, default=None, help="For NullTokenizer.")
@click.option("--output-prefix", required=True,
              help="Writes PREFIX_{key}_document.bin/.idx.")
@click.option("--append-eod", is_flag=True, help="End every document with the eod token.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tokenizing processes.")
@click.option("--skip-bad-lines", is_flag=True,
              help="Skip (and report) lines that are not a JSON object with the keys, instead "
                   "of stopping at the first.")
@click.option("--progress/--no-progress", default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def preprocess(inputs, json_keys, tokenizer_type, tokenizer_model, vocab_size, output_prefix,
               append_eod, workers, skip_bad_lines, progress, as_json):
    """Tokenize text into Megatron's .bin/.idx (like Megatron's tools/preprocess_data.py)."""
    plugin = registry.load("dataset", "indexed")
    summary = plugin.preprocess(list(inputs), output_prefix, tokenizer_type, tokenizer_model,
                                vocab_size, list(json_keys), append_eod, workers,
                                skip_bad_lines, progress, log=lambda m: click.echo(m, err=True))
    if as_json:
        click.echo(json.dumps(summary.as_dict()))
    else:
        click.echo(plugin.format_summary(summary))
