"""Adam's own options, declared by both optimizers that run AdamW (``adam`` and
``distributed-adam``; a run selects one, so the section is declared once)."""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import ConfigSection, adamw_factory, opt


@dataclass
class AdamOptions:
    adam_beta1: float = opt(0.9, "--adam-beta1", "Adam beta1.")
    adam_beta2: float = opt(0.95, "--adam-beta2", "Adam beta2.")
    adam_eps: float = opt(1e-8, "--adam-eps", "Adam epsilon.")


#: ``config.adam``; before contract 3 the fields were in ``config.training``.
SECTION = ConfigSection("adam", AdamOptions, title="Adam", formerly=("training",))


def adamw(config):
    """The AdamW ``make_inner`` of a run, with its ``--adam-*`` options."""
    a = config.adam
    return adamw_factory(config, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps)
