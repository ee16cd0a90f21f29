"""``plugtron convert import-hf`` / ``export-hf``: Hugging Face (config.json +
model.safetensors) to and from plugtron checkpoints."""

from __future__ import annotations

import click

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
@click.option("--model", default="gpt", show_default=True,
              help="Model plugin whose converter reads it (plugtron.converters).")
@click.option("--dtype", type=click.Choice(DTYPES), help="Cast the weights (default: keep).")
@user_errors
def import_hf(hf_dir, out_dir, model, dtype):
    """Write a weights-only plugtron checkpoint (iteration 0) from HF_DIR into OUT_DIR, and
    print the model flags to train or evaluate it with (--load OUT_DIR)."""
    from plugtron.core.checkpoint.hf import import_hf as run_import
    from plugtron.core.config import flag_fields, section_flag_fields

    path, config = run_import(hf_dir, out_dir, model, _dtype(dtype))
    # The model's flags, then those of plugin sections the converter set (e.g. --num-experts).
    fields = [f for f in flag_fields() if f.section == "model"]
    for name, cls in config.plugin_sections.items():
        fields += section_flag_fields(name, cls)
    parts = []
    for flag in fields:
        value = getattr(getattr(config, flag.section), flag.name)
        if value == flag.default:
            continue
        if flag.is_flag:
            parts.append(flag.flag if value else (flag.negative or ""))
        else:
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
@user_errors
def export_hf(checkpoint, out_dir, dtype, max_shard_size):
    """Write the model of CHECKPOINT (any layout; a directory of them: the newest) as a Hugging
    Face directory OUT_DIR: config.json and generation_config.json (with bos/eos/pad ids),
    the tokenizer files when the checkpoint names a tokenizer, safetensors shards."""
    from plugtron.core.checkpoint.hf import export_hf as run_export

    click.echo(f"wrote {run_export(checkpoint, out_dir, _dtype(dtype), max_shard_size)}")
