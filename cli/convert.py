"""``plugtron convert import-hf`` / ``export-hf``: Hugging Face (config.json +
model.safetensors) to and from plugtron checkpoints; ``import-megatron`` / ``export-megatron``:
Megatron-Core torch_dist checkpoints (core/interchange/megatron.py)."""

from __future__ import annotations

import click
from plugtron.core.plugins.selection import selected_driver

from .errors import user_errors

DTYPES = ("float32", "bfloat16", "float16")


def _dtype(name):
    import torch

    return getattr(torch, name) if name else None


@click.group()
def convert():
    """Convert between plugtron checkpoints and Hugging Face models."""


@convert.command("import-hf")
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.option("--model", default=None,
              help="Model plugin whose converter reads it, when several installed converters "
                   "read config.json's model_type (default: the one that declares it).")
@click.option("--dtype", type=click.Choice(DTYPES), help="Cast the weights (default: keep).")
@click.option("--peft-adapter", type=click.Path(exists=True, file_okay=False),
              help="A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) "
                   "trained on HF_DIR: imported with the model, as the model transform that "
                   "reads it (LoRA), whose flags are printed too.")
@user_errors
def import_hf(hf_dir, out_dir, model, dtype, peft_adapter):
    """Write a weights-only plugtron checkpoint (iteration 0) from HF_DIR into OUT_DIR, and
    print the model flags to train or evaluate it with (--load OUT_DIR)."""
    from plugtron.core.interchange.hf import import_hf as run_import

    path, config, flags = run_import(hf_dir, out_dir, model, _dtype(dtype), peft_adapter)
    _print_flags(path, config, flags)


def _print_flags(path, config, fixed: dict | None = None):
    """``--model NAME`` and every flag the import fixed (from the converter, whether or not it
    equals a default), then the others whose value is not the default."""
    from plugtron.core.config_flags import flag_fields, section_flag_fields

    # The model's flags, then those of plugin sections the converter set (e.g. --num-experts).
    fields = [f for f in flag_fields() if f.section == "model"]
    for name, cls in config.plugin_sections.items():
        fields += section_flag_fields(name, cls)
    fixed_names = {str(k).lstrip("-") for k in fixed or {}}
    parts = [f"--model {selected_driver(config, 'model')}"]
    for flag in fields:
        value = getattr(getattr(config, flag.section), flag.name)
        if value == flag.default and flag.flag.lstrip("-") not in fixed_names:
            continue
        if flag.is_flag:
            parts.append(flag.flag if value else (flag.negative or ""))
        elif isinstance(value, list):
            parts.append(f"{flag.flag} {','.join(map(str, value))}")
        elif value is not None:
            parts.append(f"{flag.flag} {value}")
    click.echo(f"wrote {path}")
    click.echo("model flags: " + " ".join(p for p in parts if p))


@convert.command("export-hf")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.option("--dtype", type=click.Choice(DTYPES),
              help="Cast the weights (default: keep). float32 from a bf16/fp16 run exports the "
                   "optimizer's fp32 master weights where the checkpoint has them.")
@click.option("--max-shard-size", default="50GB", show_default=True,
              help="Largest safetensors shard (e.g. 5GB, 500MB, 2GiB); more than one shard "
                   "writes model.safetensors.index.json.")
@click.option("--drop", "drop", multiple=True, metavar="PART",
              help="Leave out an optional part the model's converter offers (e.g. mtp: the "
                   "multi-token prediction layers); repeatable.")
@click.option("--adapter-only", is_flag=True,
              help="Write the run's adapter (LoRA) as a PEFT adapter directory "
                   "(adapter_config.json, adapter_model.safetensors) for the exported base "
                   "model, instead of the model with the adapter merged in.")
@user_errors
def export_hf(checkpoint, out_dir, dtype, max_shard_size, drop, adapter_only):
    """Write the model of CHECKPOINT (any layout; a directory of them: the newest) as a Hugging
    Face directory OUT_DIR: config.json and generation_config.json (with bos/eos/pad ids),
    the tokenizer files when the checkpoint names a tokenizer, safetensors shards; a model
    transform's tensors (LoRA's adapters) merged in, or with --adapter-only written alone as
    a PEFT adapter."""
    from plugtron.core.interchange.hf_export import export_hf as run_export

    written = run_export(checkpoint, out_dir, _dtype(dtype), max_shard_size, drop, adapter_only)
    click.echo(f"wrote {written}")



def _model_flags(extra: tuple, model: str) -> dict:
    """``--flag value`` / ``--flag`` pairs after ``--`` (model flags for a checkpoint that saved
    no args): the core's model section and the options of ``model``'s layers."""
    from plugtron.core.config_flags import flag_fields
    from plugtron.core.errors import ConfigError
    from plugtron.core.interchange.megatron import model_option_sections
    from plugtron.core.plugins.options import config_from_flags

    config = config_from_flags({"model": model or "auto"}, "--model")
    sections = model_option_sections(config)
    fields = [f for f in flag_fields(config) if f.section in sections]
    known = {f.flag: f for f in fields}
    negative = {f.negative: f for f in fields if f.negative}
    out, items = {}, list(extra)
    while items:
        flag = items.pop(0)
        name, _, value = flag.partition("=")
        if name in negative:
            out[negative[name].name] = False
            continue
        field = known.get(name)
        if field is None:
            raise ConfigError(f"{flag!r} is not a model flag; after the directories only model "
                              f"flags are accepted (e.g. --num-attention-heads 4)")
        if field.is_flag:
            out[field.name] = True
        elif value or (items and not items[0].startswith("--")):
            out[field.name] = value or items.pop(0)
        else:
            raise ConfigError(f"{name} needs a value")
    return out


@convert.command("import-megatron",
                 context_settings={"ignore_unknown_options": True})
@click.argument("megatron_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.argument("model_flags", nargs=-1, type=click.UNPROCESSED)
@click.option("--model", default=None,
              help="Model plugin whose converter reads it (plugtron.converters; default: the "
                   "one the installed selectors choose, gpt with plugtron-gpt).")
@click.option("--dtype", type=click.Choice(DTYPES), help="Cast the weights (default: keep).")
@user_errors
def import_megatron(megatron_dir, out_dir, model_flags, model, dtype):
    """Write a weights-only plugtron checkpoint from a Megatron-Core torch_dist checkpoint
    (MEGATRON_DIR: the --save directory or one iter_XXXXXXX in it). The model flags come from
    the checkpoint's saved args; model flags given after the directories override them (needed
    only for a checkpoint saved without args)."""
    from plugtron.core.interchange.megatron import import_megatron as run_import

    path, config = run_import(megatron_dir, out_dir, model, _model_flags(model_flags, model),
                              _dtype(dtype))
    _print_flags(path, config)


@convert.command("export-megatron")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.option("--dtype", type=click.Choice(DTYPES), help="Cast the weights (default: keep).")
@click.option("--drop", "drop", multiple=True, metavar="PART",
              help="Leave out an optional part the model's converter offers (e.g. mtp: the "
                   "multi-token prediction layers); repeatable.")
@user_errors
def export_megatron(checkpoint, out_dir, dtype, drop):
    """Write the model of CHECKPOINT as a Megatron-Core torch_dist save directory OUT_DIR
    (local layer spec names, layers stacked; load it with --ckpt-format torch_dist
    --no-load-optim --no-load-rng)."""
    from plugtron.core.interchange.megatron import export_megatron as run_export

    click.echo(f"wrote {run_export(checkpoint, out_dir, _dtype(dtype), drop)}")
