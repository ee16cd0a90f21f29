"""``plugtron plot RUN.jsonl [RUN2.jsonl ...] -o curves.png``: training curves from metrics files."""

from __future__ import annotations

import json
import os

import click
from plugtron.core.errors import ConfigError

from .errors import user_errors

#: (title, metrics-file key) of each panel; the loss panel also draws the validation curve.
PANELS = (("loss", None), ("learning rate", "lr"), ("grad norm", "grad_norm"),
          ("tokens/s", "tokens_per_sec"))


def read_run(path: str) -> dict:
    """A metrics file's training and validation records and the main loss key."""
    train, valid, main = [], [], "lm_loss"
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{path} line {number} is not JSON: {line[:60]!r}") from None
            if record.get("summary"):
                main = record.get("main_loss") or main
            elif "grad_norm" in record:
                train.append(record)
            elif "iteration" in record:
                valid.append(record)
    if not train:
        raise ConfigError(f"{path} holds no training records (written by --metrics-file?)")
    return {"train": train, "valid": valid, "main": main}


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(paths: list[str], output: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plugtron plot needs matplotlib: pip install 'plugtron[plot]'") from None
    runs = {os.path.basename(p): read_run(p) for p in paths}
    figure, axes = plt.subplots(2, 2, figsize=(11, 7))
    for (title, key), axis in zip(PANELS, axes.flat):
        for label, run in runs.items():
            if key is None:
                main = run["main"]
                line, = axis.plot(*_series(run["train"], main), label=f"{label} train")
                xs, ys = _series(run["valid"], f"valid_{main}")
                if xs:
                    axis.plot(xs, ys, "o--", color=line.get_color(), label=f"{label} valid")
            else:
                axis.plot(*_series(run["train"], key), label=label)
        axis.set_title(title)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)


@click.command()
@click.argument("metrics_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", default="curves.png", show_default=True,
              type=click.Path(dir_okay=False), help="PNG to write.")
@user_errors
def plot(metrics_files, output):
    """Loss (train and validation), learning rate, grad norm and tokens/s against iterations,
    one curve per metrics file (--metrics-file of plugtron train)."""
    for path in metrics_files:
        if not os.path.isfile(path):
            raise ConfigError(f"metrics file {path!r} does not exist")
    plot_runs(list(metrics_files), output)
    click.echo(f"wrote {output}")
