"""``plugtron data``: prepare corpora in Megatron's ``.bin/.idx`` format, and see what a run
will see.

``preprocess`` is done by the ``indexed`` dataset plugin (loaded through the registry, as a run
loads it). ``inspect`` and ``stats`` take the run's own flags (any ``train`` flag, so a training
command line can be pasted), build its datasets in this process as a run's rank 0 would, and
print; this module only parses flags and prints.
"""

from __future__ import annotations

import contextlib
import json
import sys

import click
from plugtron.core.errors import ConfigError
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import selected_driver

from .errors import user_errors
from .options import (
    SectionedCommand,
    build_config,
    config_options,
    declared_sections,
    headings,
    model_presets,
    prescan,
)

SPLITS = ("train", "valid", "test")


class DataGroup(click.Group):
    """``inspect`` and ``stats`` are built for their arguments (like ``train``), so the selected
    dataset plugin's flags exist."""

    def get_command(self, ctx, cmd_name):
        if cmd_name in RUN_AWARE:
            return RUN_AWARE[cmd_name](getattr(ctx, "_plugtron_args", []))
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(RUN_AWARE))

    def resolve_command(self, ctx, args):
        ctx._plugtron_args = list(args[1:])
        return super().resolve_command(ctx, args)


@click.group(cls=DataGroup)
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


# --------------------------------------------------------------------------- inspect, stats


def run_datasets(config):
    """The run's (train, valid, test) as its provider builds them, and its tokenizer (or
    ``None``), on one process."""
    from plugtron.core.parallel.context import ParallelContext
    from plugtron.core.plugins.manager import build_plugin_manager
    from plugtron.core.plugins.options import with_plugin_sections
    from plugtron.core.plugins.tokenizers import build_tokenizer
    from plugtron.core.training.loop import split_sizes

    from .train import check_data_paths, check_plugins

    with_plugin_sections(config)
    check_plugins(config)
    check_data_paths(config)
    pm = build_plugin_manager(config)
    with contextlib.redirect_stdout(sys.stderr):  # the provider's log; stdout is the report
        datasets = tuple(pm.hook.dataset_provider(config=config, split_sizes=split_sizes(config),
                                                  parallel=ParallelContext.build(1, 0)))
    tokenizer = None
    if config.data.tokenizer_type:
        tokenizer = build_tokenizer(config.data.tokenizer_type, config.data.tokenizer_model,
                                    config.model.vocab_size)
    return datasets, tokenizer


def _run_data_command(name: str, args: list[str], body, extra_options=()):
    selection = prescan(args)
    declared = declared_sections(selection)
    presets = model_presets(selection)

    def command(config_file, preset, as_json, **params):
        own = {key: params.pop(key) for key in [o.name for o in extra_options]}
        config = build_config(params, config_file, preset, declared=declared, presets=presets)
        body(config, as_json, **own)

    command.__doc__ = body.__doc__
    command = user_errors(command)
    command = config_options(declared)(command)
    for option in reversed(extra_options):
        command = option(command)
    command = click.option("--json", "as_json", is_flag=True, help="Print JSON.")(command)
    command = click.option("--preset", help="Named model size of the selected model.")(command)
    command = click.option("--config", "config_file", type=click.Path(dir_okay=False),
                           help="YAML or TOML file of settings; flags override it.")(command)
    return click.command(name, cls=SectionedCommand, headings=headings(declared),
                         context_settings={"max_content_width": 100})(command)


class _Extra:
    """A command-specific option and its parameter name (kept apart from the run's flags)."""

    def __init__(self, name, *decls, **attrs):
        self.name = name
        self._option = click.option(*decls, name, **attrs)

    def __call__(self, func):
        return self._option(func)


def _inspect(config, as_json, split_name, num_samples, start):
    """Print the first samples of a split exactly as the run with these flags draws them
    (global sample order: the run's step k starts at sample k x --global-batch-size): token ids,
    and the text when the run has a tokenizer."""
    from plugtron.plugins.datasets.inspection import sample_records

    datasets, tokenizer = run_datasets(config)
    dataset = datasets[SPLITS.index(split_name)]
    if dataset is None or len(dataset) == 0:
        raise ConfigError(f"the {split_name} split of this run is empty (see --split and "
                          f"--train-iters/--eval-iters)")
    if start >= len(dataset):
        raise ConfigError(f"--start {start} is past the {split_name} split's {len(dataset)} "
                          f"samples")
    records = sample_records(dataset, start, num_samples, tokenizer)
    if as_json:
        click.echo(json.dumps({"data": selected_driver(config, "dataset"), "split": split_name,
                               "samples_in_split": len(dataset),
                               "tokenizer": config.data.tokenizer_type, "samples": records}))
        return
    click.echo(f"data {selected_driver(config, 'dataset')}, {split_name} split: {len(dataset)} samples of "
               f"{config.model.seq_length} tokens; tokenizer {config.data.tokenizer_type}")
    for record in records:
        extra = ""
        if "attention_mask" in record:
            extra = f", {len(set(record['attention_mask']))} document(s)"
        loss = int(sum(record["loss_mask"]))
        click.echo(f"sample {record['index']}: loss on {loss} of {len(record['tokens'])} "
                   f"tokens{extra}")
        click.echo(f"  ids:  {record['tokens']}")
        if "text" in record:
            click.echo(f"  text: {record['text']!r}")
        for number, document in enumerate(record.get("documents", [])):
            first, last = document["positions"]
            shown = document.get("text", document.get("ids"))
            click.echo(f"  document {number}, positions {first}-{last}: {shown!r}")
            click.echo(f"    loss on {document['loss_tokens']} token(s): "
                       f"{document['learns']!r}")


def _stats(config, as_json):
    """Documents, tokens, document-length histogram and epochs of each split, and a blend's
    effective weights over the samples the run draws, for the run these flags describe."""
    from plugtron.core.training.loop import split_sizes
    from plugtron.plugins.datasets.inspection import format_stats, split_stats

    datasets, _ = run_datasets(config)
    needed = split_sizes(config)
    stats = {"data": selected_driver(config, "dataset"), "seq_length": config.model.seq_length,
             "tokenizer": config.data.tokenizer_type,
             "splits": {split: split_stats(dataset, n)
                        for split, dataset, n in zip(SPLITS, datasets, needed)}}
    click.echo(json.dumps(stats) if as_json else format_stats(stats))


RUN_AWARE = {
    "inspect": lambda args: _run_data_command("inspect", args, _inspect, [
        _Extra("split_name", "--split-name", type=click.Choice(SPLITS), default="train",
               show_default=True, help="Which split's samples."),
        _Extra("num_samples", "--num-samples", type=click.IntRange(min=1), default=4,
               show_default=True, help="How many samples."),
        _Extra("start", "--start", type=click.IntRange(min=0), default=0, show_default=True,
               help="The first sample's index in the split.")]),
    "stats": lambda args: _run_data_command("stats", args, _stats),
}
