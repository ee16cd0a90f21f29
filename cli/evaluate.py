"""``plugtron evaluate --load DIR``: the validation loss of a checkpoint, in any layout."""

from __future__ import annotations

import os

import click
from plugtron.core.config import CheckpointConfig, LoggingConfig, ParallelConfig, TrainConfig
from plugtron.core.config_freeze import freeze
from plugtron.core.errors import ConfigError, PlugtronError
from plugtron.core.parallel.distributed import launched_externally
from plugtron.core.training.validate import validate

from .errors import user_errors
from .launch import launch_local_ranks
from .options import (
    SectionedCommand,
    build_config,
    config_options,
    declared_sections,
    headings,
    prescan,
)
from .preflight import check_memory, preflight
from .train import (
    HFLoad,
    check_data_paths,
    check_plugins,
    given_model,
    load_argument,
    ranks_on_node,
)

#: Tells launched ranks to print JSON lines (``--json``).
JSON_ENV = "PLUGTRON_EVALUATE_JSON"


def checkpoint_base(load: str | None, model: str = "gpt") -> TrainConfig:
    """The checkpoint's own settings (model, data, seed, plugin sections), with the layout,
    checkpoint and logging sections reset. A Hugging Face directory is imported (cached) and
    read as its checkpoint."""
    from plugtron.core.checkpoint import CheckpointReader
    from plugtron.core.interchange import hf_load
    from plugtron.core.plugins.options import config_from_dict

    if not load:
        raise ConfigError("plugtron evaluate needs --load DIR (a checkpoint or a directory of "
                          "them, or a Hugging Face model directory)")
    if hf_load.is_hf_dir(load):
        load = hf_load.import_cached(load, model)
    reader = CheckpointReader(load)
    base = config_from_dict(reader.config)
    base.parallel, base.logging = ParallelConfig(), LoggingConfig()
    base.checkpoint = CheckpointConfig()
    base.checkpoint.load = reader.path
    base.model.padded_vocab_size = None  # recomputed for this run's tp
    return base


def evaluation_config(params: dict, config_file: str | None, declared=(),
                      hf: HFLoad | None = None) -> TrainConfig:
    """The checkpoint's settings; the config file and flags override (except the settings a
    Hugging Face directory's config.json fixes: those must agree)."""
    base = hf.config_base() if hf is not None and hf.dir else None
    if base is None:
        base = checkpoint_base(params.get("checkpoint__load"))
    load = base.checkpoint.load
    trained_with = (base.data.tokenizer_type, base.data.tokenizer_model)
    config = build_config(params, config_file, None, base=base, declared=declared)
    if (config.data.tokenizer_type, config.data.tokenizer_model) != trained_with:
        # another tokenizer named: its vocabulary, not the checkpoint's, is what it would give
        # (checked against the checkpoint's before launch, below)
        if params.get("model__vocab_size") is None:
            config.model.vocab_size = None
    config.checkpoint.load = load
    if hf is not None:
        hf.finish(config)
    config.checkpoint.save = config.checkpoint.save_interval = None
    if config.training.eval_iters < 1:
        raise ConfigError("plugtron evaluate needs --eval-iters of at least 1")
    return config


def make_evaluate_command(args: list[str]) -> click.Command:
    """``evaluate`` with the options of the plugins the checkpoint (and ``args``) select."""
    hf = HFLoad(args, given_model(prescan(args)))
    try:
        base = hf.config_base() if hf.dir else checkpoint_base(load_argument(args))
    except PlugtronError:
        base = None  # reported when the command runs
    declared = declared_sections(prescan(args, base))

    @click.command(cls=SectionedCommand, headings=headings(declared),
                   context_settings={"max_content_width": 100})
    @click.option("--config", "config_file", type=click.Path(dir_okay=False),
                  help="YAML or TOML file of settings; flags override it.")
    @click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
                  help="Launch this many local ranks (through torch.distributed.run).")
    @click.option("--json", "as_json", is_flag=True,
                  help="One JSON line per document set (loss, perplexity) instead of text.")
    @click.option("--no-memory-check", "no_memory_check", is_flag=True,
                  help="Launch even when the memory estimate (plugtron estimate) exceeds the "
                  "memory of a rank.")
    @config_options(declared)
    @user_errors
    def evaluate(config_file, nproc_per_node, as_json, no_memory_check, **params):
        """Validation losses (valid_<report key>) and perplexity of checkpoint --load (or a
        Hugging Face model directory) on the data the data flags give (--data, --data-path,
        --split, --eval-iters), in the layout the parallel flags give; several --data-path sets
        give one line each. Model settings come from the checkpoint; flags override them."""
        config = evaluation_config(params, config_file, declared, hf)
        external = launched_externally()
        world_size = int(os.environ["WORLD_SIZE"]) if external else nproc_per_node
        check_plugins(config)
        preflight(config, world_size, memory_check=False)
        validate(config, world_size)
        freeze(config)  # validated: nothing after this changes a setting
        check_data_paths(config)
        if not no_memory_check:
            check_memory(config, world_size, ranks_on_node(external, nproc_per_node))
        from plugtron.core.plugins.tokenizers import check_checkpoint_tokenizer

        check_checkpoint_tokenizer(config)  # the checkpoint's own unless flags name another
        if nproc_per_node > 1 and not external:
            os.environ[JSON_ENV] = "1" if as_json else ""  # the ranks print
            try:
                launch_local_ranks(config.to_json(), nproc_per_node, command="evaluate")
            finally:
                os.environ.pop(JSON_ENV, None)
            return
        from plugtron.core.tools.evaluate import evaluate_checkpoint

        evaluate_checkpoint(config, as_json=as_json)

    return evaluate
