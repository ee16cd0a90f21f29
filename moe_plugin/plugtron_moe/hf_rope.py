"""Rotary settings of the MoE families' Hugging Face configs (``rope_parameters``, or the older
``rope_scaling``) to plugtron's flags and back: plain rotary and YaRN (``rope_type: yarn``,
the GPT model's ``--rope-type yarn`` and its options). Other scalings are refused by name.

The GPT plugin's Llama-family converter reads the same fields (gpt/hf_families.py); repeated
here because a plugin does not import another's internals.

How transformers reads a YaRN config, and so what the flags must say:

* ``factor`` is required (transformers' MLA softmax correction needs it);
* ``original_max_position_embeddings``: a top-level field of that name wins over the one in
  the rope parameters, which wins over ``max_position_embeddings``;
* the attention factor on cos and sin is ``attention_factor`` where given, else
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` only when both are set (nonzero),
  else ``mscale(factor)``: plugtron's ``--mscale`` / ``--mscale-all-dim`` are set to give the
  same value, and a config whose value no setting gives is refused;
* multi-latent attention also multiplies its softmax scale by ``mscale(factor,
  mscale_all_dim)^2`` when ``mscale_all_dim`` is set; plugtron's ``--mscale-all-dim`` does both
  (so with MLA a ``mscale_all_dim`` without ``mscale`` is refused unless ``attention_factor``
  makes the two agree);
* ``beta_fast`` / ``beta_slow`` default to 32 / 1, ``truncate`` to true.
"""

from __future__ import annotations

import math

from plugtron.api import ConfigError


def _params(c: dict) -> dict:
    params = dict(c.get("rope_scaling") or {})
    params.update(c.get("rope_parameters") or {})  # transformers 5's name wins
    return params


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 mscale ln(factor) + 1`` (1 for factors up to 1), as the GPT plugin's rope."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_flags(c: dict, mla: bool = False) -> dict:
    """``rotary-base`` and, for YaRN, ``rope-type yarn`` with its options; ConfigError for the
    scalings plugtron does not convert for these families."""
    params = _params(c)
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported: plugtron rotates every "
                          "rotary channel of a head")
    flags: dict = {"rotary-base": theta}
    if kind == "default":
        return flags
    if kind != "yarn":
        raise ConfigError(f"rope type {kind!r} is not supported for this family by plugtron: "
                          f"it converts plain rotary ('default') and 'yarn' exactly; {kind!r} "
                          f"would compute different angles")
    return flags | yarn_flags(params, c, mla)


def yarn_flags(params: dict, c: dict, mla: bool) -> dict:
    """The ``--rope-type yarn`` flags that compute what transformers computes from ``params``
    (module docstring)."""
    factor = params.get("factor")
    if factor is None:
        raise ConfigError("config.json rope_parameters (yarn) has no 'factor'")
    factor = float(factor)
    original = (c.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or c.get("max_position_embeddings"))
    if original is None:
        raise ConfigError("config.json rope_parameters (yarn) has no "
                          "'original_max_position_embeddings'")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and all_dim)
    given = params.get("attention_factor")
    # Without attention_factor transformers ignores mscale unless mscale_all_dim is set too;
    # with it (plugtron's export writes one then), the file's values are taken as they are.
    literal = given is not None or both
    ours = (float(1.0 if mscale is None else mscale) if literal else 1.0,
            float(all_dim or 0.0) if literal or mla else 0.0)
    computed = _mscale(factor, ours[0]) / _mscale(factor, ours[1])
    theirs = float(given) if given is not None else computed if both else _mscale(factor)
    if not math.isclose(theirs, computed, rel_tol=1e-12):
        raise ConfigError(
            f"rope_parameters (yarn): transformers scales cos and sin by {theirs} (factor "
            f"{factor}, mscale {mscale}, mscale_all_dim {all_dim}, attention_factor {given}), "
            f"but plugtron's --mscale / --mscale-all-dim give {computed}"
            + (" (with multi-latent attention --mscale-all-dim also sets the softmax "
               "correction, so it must be mscale_all_dim)" if mla and all_dim else "")
            + "; no flag value gives both")
    return {"rope-type": "yarn", "rotary-scaling-factor": factor,
            "yarn-original-max-position-embeddings": int(original),
            "mscale": ours[0], "mscale-all-dim": ours[1],
            "yarn-beta-fast": float(params.get("beta_fast") or 32),
            "yarn-beta-slow": float(params.get("beta_slow") or 1),
            "yarn-correction-range-round-to-int": bool(params.get("truncate", True))}


def rope_config(config) -> dict:
    """``rope_theta`` and ``rope_parameters`` of a run config for config.json; ConfigError for
    a rotary scaling these families are not exported with."""
    m, o = config.model, getattr(config, "attention", None)
    theta = float(m.rotary_base)
    params: dict = {"rope_theta": theta, "rope_type": "default"}
    if getattr(o, "use_rope_scaling", False) or getattr(
            o, "rotary_seq_len_interpolation_factor", None) is not None:
        raise ConfigError("--use-rope-scaling / --rotary-seq-len-interpolation-factor: the MoE "
                          "families are exported with plain rotary or --rope-type yarn only")
    if getattr(o, "rope_type", None) == "yarn":
        factor, mscale, all_dim = o.rotary_scaling_factor, o.mscale, o.mscale_all_dim
        params = {"rope_theta": theta, "rope_type": "yarn", "factor": factor,
                  "original_max_position_embeddings": o.yarn_original_max_position_embeddings,
                  "beta_fast": o.yarn_beta_fast, "beta_slow": o.yarn_beta_slow,
                  "truncate": o.yarn_correction_range_round_to_int,
                  "mscale": mscale, "mscale_all_dim": all_dim}
        ours = _mscale(factor, mscale) / _mscale(factor, all_dim)
        theirs = ours if mscale and all_dim else _mscale(factor)
        if theirs != ours:  # transformers would infer another attention factor: state it
            params["attention_factor"] = ours
    return {"rope_theta": theta, "rope_parameters": params}
