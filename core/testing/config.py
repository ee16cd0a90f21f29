"""The one place the kit turns a dict of flags into a ``TrainConfig``.

Every check in the kit builds its runs' configs through :func:`make_config`, so a change in how
configs are assembled (for example plugins declaring their own config sections) is made here and
nowhere else.
"""

from __future__ import annotations

import math

from plugtron.core.config import TrainConfig
from plugtron.core.plugins.options import config_from_flags

#: Tiny settings under which a run takes well under a second per iteration on one CPU core:
#: fp32, mock data, no dropout, no evaluation or logging unless asked. The vocabulary (128, a
#: multiple of 8 x tp for tp <= 16) pads to the same size under every tensor-parallel size, so
#: parameters compare one to one across layouts. 4 layers split over pp 2 x vp 2.
DEFAULT_FLAGS = {
    "model": "gpt", "data": "mock", "num-layers": 4, "hidden-size": 32,
    "num-attention-heads": 4, "seq-length": 16, "vocab-size": 128,
    "make-vocab-size-divisible-by": 8, "micro-batch-size": 2, "global-batch-size": 8,
    "train-iters": 3, "eval-iters": 1, "eval-interval": 0, "lr": 1e-3, "min-lr": 1e-4,
    "lr-warmup-iters": 1, "hidden-dropout": 0.0, "attention-dropout": 0.0,
    "progress": False, "log-interval": 0,
}

#: Short names of the layout sizes (the CLI's aliases) and the long flag each stands for.
_SIZE_FLAGS = {
    "tp": "tensor-model-parallel-size", "pp": "pipeline-model-parallel-size",
    "cp": "context-parallel-size",
}


def canonical(key: str) -> str:
    """A flag name as the kit compares them: no leading dashes, dashes not underscores."""
    return str(key).lstrip("-").replace("_", "-")


def merge_flags(*dicts: dict) -> dict:
    """Later dicts win, whatever spelling each uses for a flag (``num_layers`` and
    ``--num-layers`` are one key); keys come back in canonical spelling."""
    out: dict = {}
    for flags in dicts:
        out.update({canonical(k): v for k, v in flags.items()})
    return out


def layout_size(flags: dict, name: str) -> int:
    """The value of one parallel size (``tp``, ``pp``, ``cp`` or ``dp``) in ``flags``; 1 when
    absent. ``dp`` is the kit's own key: it is not a config value."""
    flags = merge_flags(flags)
    long = _SIZE_FLAGS.get(name)
    value = flags.get(name, flags.get(long, 1) if long else 1)
    return int(value or 1)


def world_size_of(flags: dict) -> int:
    """The ranks a layout needs: tp x pp x cp x dp (each 1 when absent)."""
    return math.prod(layout_size(flags, name) for name in ("tp", "pp", "cp", "dp"))


def make_config(flags: dict) -> TrainConfig:
    """A ``TrainConfig`` from :data:`DEFAULT_FLAGS` overridden by ``flags``.

    Keys are flag names with or without dashes, or field names (``"num-layers"``,
    ``"--num-layers"``, ``"num_layers"``), and the CLI's short aliases (``tp``, ``pp``, ``vp``,
    ``cp``). ``dp`` is accepted and dropped: data parallelism is what the world leaves after
    tp x pp x cp, so it is fixed by the world a run starts on (see :func:`world_size_of`).
    The options the selected plugins declare (their config sections) are accepted as well.
    Values are typed as the CLI would type them; an unknown key raises ``ConfigError``.
    """
    values = {k: v for k, v in merge_flags(DEFAULT_FLAGS, flags).items() if k != "dp"}
    # The selected plugins' own options (their config sections) are accepted too.
    return config_from_flags(values, "plugtron.testing")


#: The flag that selects a plugin of each role.
SELECTING = {"model": "model", "schedule": "schedule", "optimizer": "optimizer",
             "data_parallel": "data-parallel", "dataset": "data", "layer_backend": "layer-backend"}


def own_flags(flags: dict, role: str, name: str) -> set[str]:
    """The keys of ``flags`` that are options of the ``role`` plugin ``name`` (its config
    sections), in canonical spelling: a reference run that does not select that plugin must
    not be given them."""
    from plugtron.core.config_flags import section_flag_fields  # noqa: PLC0415 - the kit's config helpers stay light to import
    from plugtron.core.plugins.options import collect_sections  # noqa: PLC0415 - as above

    config = make_config(merge_flags(flags, {SELECTING[role]: name}))
    spellings = set()
    for declared in collect_sections(config):
        if (declared.plugin.role, declared.plugin.name) != (role, name):
            continue
        for f in section_flag_fields(declared.section.name, declared.section.cls):
            spellings |= {canonical(s) for s in (f.flag, *f.aliases, f.negative) if s}
            spellings.add(canonical(f.name))
    return {k for k in merge_flags(flags) if k in spellings}
