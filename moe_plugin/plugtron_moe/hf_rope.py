"""Rotary settings of the MoE families' Hugging Face configs (``rope_parameters``, or the older
``rope_scaling``) to plugtron's flags and back: plain rotary and YaRN (``rope_type: yarn``,
the GPT model's ``--rope-type yarn`` and its options). Other scalings are refused by name.

The reading and writing are the gpt converter's (``hf_rope_flags`` / ``hf_rope_config``,
gpt/hf_families.py), reached through the registry like its Megatron mapping, so that one
place knows how transformers reads a YaRN config (its docstring); the MoE families accept
only plain rotary and YaRN of the scalings it knows.
"""

from __future__ import annotations

from plugtron.api import ConfigError

from .megatron_convert import gpt_converter

#: The rotary scalings these families convert (plus plain rotary).
SCALINGS = ("default", "yarn")


def _kind(c: dict) -> str:
    params = dict(c.get("rope_scaling") or {})
    params.update(c.get("rope_parameters") or {})  # transformers 5's name wins
    return params.get("rope_type") or params.get("type") or "default"


def rope_flags(c: dict, mla: bool = False) -> dict:
    """``rotary-base`` and, for YaRN, ``rope-type yarn`` with its options; ConfigError for the
    scalings plugtron does not convert for these families."""
    kind = _kind(c)
    if kind not in SCALINGS:
        raise ConfigError(f"rope type {kind!r} is not supported for this family by plugtron: "
                          f"it converts plain rotary ('default') and 'yarn' exactly; {kind!r} "
                          f"would compute different angles")
    return gpt_converter("gpt").hf_rope_flags(c, mla)


def rope_config(config) -> dict:
    """``rope_theta`` and ``rope_parameters`` of a run config for config.json; ConfigError for
    a rotary scaling these families are not exported with."""
    o = getattr(config, "attention", None)
    if getattr(o, "use_rope_scaling", False) or getattr(
            o, "rotary_seq_len_interpolation_factor", None) is not None:
        raise ConfigError("--use-rope-scaling / --rotary-seq-len-interpolation-factor: the MoE "
                          "families are exported with plain rotary or --rope-type yarn only")
    return gpt_converter("gpt").hf_rope_config(config)
