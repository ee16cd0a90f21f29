"""The MoE options: Megatron-LM's flags, names and defaults, as the ``moe`` config section."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from plugtron.api import ConfigError, opt


@dataclass
class MoEOptions:
    num_experts: int | None = opt(None, "--num-experts",
                                  "Number of routed experts; set it to turn the MLP of the "
                                  "layers --moe-layer-freq selects into an MoE layer.")
    moe_ffn_hidden_size: int | None = opt(None, "--moe-ffn-hidden-size",
                                          "Hidden size of each routed expert (default "
                                          "--ffn-hidden-size).")
    moe_layer_freq: str = opt("1", "--moe-layer-freq",
                              "Which layers are MoE: an int N (every N-th layer, from the "
                              "first) or a Python list expression of 0/1 per layer, e.g. "
                              "'([0]+[1]*3)*2'.")
    moe_router_topk: int = opt(2, "--moe-router-topk", "Experts per token.")
    moe_router_score_function: str = opt("softmax", "--moe-router-score-function",
                                         "Router score function: softmax, sigmoid, or "
                                         "sqrtsoftplus (sqrt(softplus(logit))).",
                                         choices=("softmax", "sigmoid", "sqrtsoftplus"))
    moe_router_pre_softmax: bool = opt(False, "--moe-router-pre-softmax",
                                       "Softmax over all experts before top-k (no "
                                       "renormalisation).", is_flag=True)
    moe_router_num_groups: int | None = opt(None, "--moe-router-num-groups",
                                            "Expert groups for group-limited routing.")
    moe_router_group_topk: int | None = opt(None, "--moe-router-group-topk",
                                            "Groups each token may use (group-limited "
                                            "routing).")
    moe_router_topk_scaling_factor: float | None = opt(None, "--moe-router-topk-scaling-factor",
                                                       "Multiply the routing weights by this.")
    # Megatron's nargs='+': one type, or several balancing losses at once with one coefficient
    # each (``--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff
    # 1e-2 1e-3``). A value given on the command line or in a file is a list; the default and
    # the configs of older checkpoints are a single value: read them with load_balancing().
    moe_router_load_balancing_type: list[str] | str = opt(
        "aux_loss", "--moe-router-load-balancing-type",
        "Load-balancing loss; several (aux_loss, seq_aux_loss, global_aux_loss) add up, each "
        "with its own --moe-aux-loss-coeff. sinkhorn: S-BASE routing instead of a loss.",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
    moe_aux_loss_coeff: list[float] | float = opt(
        0.0, "--moe-aux-loss-coeff",
        "Coefficient of the load-balancing loss (0: off); one per "
        "--moe-router-load-balancing-type when several are given.")
    moe_z_loss_coeff: float | None = opt(None, "--moe-z-loss-coeff",
                                         "Coefficient of the router z-loss.")
    moe_router_enable_expert_bias: bool = opt(
        False, "--moe-router-enable-expert-bias",
        "Aux-loss-free balancing: a per-expert bias on the selection scores, updated after "
        "each step (sigmoid or sqrtsoftplus scores).", is_flag=True)
    moe_router_bias_update_rate: float = opt(1e-3, "--moe-router-bias-update-rate",
                                             "Step of the expert-bias update.")
    moe_router_dtype: str | None = opt(None, "--moe-router-dtype",
                                       "Dtype of the router's computation (default: the "
                                       "model's).", choices=("fp32", "fp64"))
    moe_input_jitter_eps: float | None = opt(None, "--moe-input-jitter-eps",
                                             "Multiply router inputs by U(1-eps, 1+eps) in "
                                             "training.")
    moe_expert_capacity_factor: float | None = opt(None, "--moe-expert-capacity-factor",
                                                   "Expert capacity factor (default: no "
                                                   "dropping).")
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "--moe-pad-expert-input-to-capacity",
        "Fill every expert to exactly its capacity (needs a capacity factor).", is_flag=True)
    moe_token_drop_policy: str = opt("probs", "--moe-token-drop-policy",
                                     "Which tokens an over-full expert keeps.",
                                     choices=("probs", "position"))
    moe_shared_expert_intermediate_size: int | None = opt(
        None, "--moe-shared-expert-intermediate-size",
        "Hidden size of the shared expert (all shared experts together); none when unset.")
    moe_shared_expert_gate: bool = opt(False, "--moe-shared-expert-gate",
                                       "Sigmoid gate on the shared expert's output.",
                                       is_flag=True)
    moe_grouped_gemm: bool = opt(False, "--moe-grouped-gemm",
                                 "One grouped matmul over the local experts instead of a loop.",
                                 is_flag=True)
    moe_token_dispatcher_type: str = opt("allgather", "--moe-token-dispatcher-type",
                                         "Token dispatcher: any installed "
                                         "plugtron.moe_dispatchers name (allgather, alltoall).")
    moe_per_layer_logging: bool = opt(False, "--moe-per-layer-logging",
                                      "Also log the aux losses of each layer.", is_flag=True)


#: The balancing losses that may be combined, and the names they are reported under when they
#: are (Megatron's); a single type is reported as ``load_balancing_loss`` whatever it is.
BALANCING_LOSSES = {"aux_loss": "load_balancing_loss",
                    "seq_aux_loss": "seq_load_balancing_loss",
                    "global_aux_loss": "global_load_balancing_loss"}
BALANCING_TYPES = (*BALANCING_LOSSES, "sinkhorn", "none")


def load_balancing(options) -> list[tuple[str, float, str]]:
    """The balancing losses a run adds, ``[(type, coefficient, reported name)]``, from
    ``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff`` (each a single value or a
    list, as Megatron's nargs='+'): the types whose coefficient is positive (Megatron's
    ``get_aux_loss_coeff(type) > 0``). Raises ConfigError on lists that do not pair up."""
    types, coeffs = options.moe_router_load_balancing_type, options.moe_aux_loss_coeff
    types = list(types) if isinstance(types, (list, tuple)) else [types]
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs]
    shown = " ".join(str(t) for t in types)
    if not types:
        raise ConfigError("--moe-router-load-balancing-type needs a value: one of "
                          f"{', '.join(BALANCING_TYPES)}")
    values = []
    for c in coeffs:
        try:
            values.append(float(c))
        except (TypeError, ValueError):
            raise ConfigError(f"--moe-aux-loss-coeff {c!r} is not a number") from None
    if len(values) != len(types):
        raise ConfigError(f"--moe-aux-loss-coeff gives {len(values)} coefficient(s) for "
                          f"{len(types)} --moe-router-load-balancing-type(s) ({shown}): give "
                          f"one coefficient per type, in the same order")
    unknown = [t for t in types if t not in BALANCING_TYPES]
    if unknown:
        raise ConfigError(f"--moe-router-load-balancing-type {' '.join(map(str, unknown))} is "
                          f"not one of {', '.join(BALANCING_TYPES)}")
    if len(types) > 1 and len(set(types)) != len(types):
        raise ConfigError(f"--moe-router-load-balancing-type {shown} names a type twice; "
                          f"give each once with its coefficient")
    if "sinkhorn" in types and len(types) > 1:
        raise ConfigError(f"--moe-router-load-balancing-type {shown}: sinkhorn is a way of "
                          f"routing, not a loss to add; give it alone, or combine aux_loss, "
                          f"seq_aux_loss and global_aux_loss")
    if types == ["sinkhorn"] and values[0] > 0:
        raise ConfigError(f"--moe-router-load-balancing-type sinkhorn balances by routing and "
                          f"takes no balancing loss (as Megatron): drop --moe-aux-loss-coeff "
                          f"{values[0]:g}, or use aux_loss, seq_aux_loss or global_aux_loss")
    named = len(types) > 1
    return [(t, c, BALANCING_LOSSES[t] if named else "load_balancing_loss")
            for t, c in zip(types, values) if t != "none" and c > 0]


def uses_sinkhorn(options) -> bool:
    """``--moe-router-load-balancing-type sinkhorn`` (alone)."""
    kind = options.moe_router_load_balancing_type
    return (list(kind) if isinstance(kind, (list, tuple)) else [kind]) == ["sinkhorn"]


#: Longest list a --moe-layer-freq expression may build (far beyond any model's layer count):
#: ``[0]*10**9`` is refused before it is allocated.
MAX_PATTERN_LENGTH = 100_000


def _pattern_value(node, text: str):
    """The value of one node of a ``--moe-layer-freq`` list expression: integers, lists (or
    parenthesised tuples) of them, ``+`` of lists or integers, ``*`` of a list by an integer.
    Nothing else is evaluated (no names, calls, attributes, comprehensions or ``**``)."""
    def bad(what: str):
        return ConfigError(f"--moe-layer-freq {text!r}: {what}; expected an int or a list "
                           f"expression of 0/1 such as '([0]*3+[1]*58)'")

    if isinstance(node, ast.Constant) and isinstance(node.value, int):  # bools: 0/1 too
        return int(node.value)
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_pattern_value(item, text) for item in node.elts]
        if any(isinstance(item, list) for item in items):
            raise bad("lists may not be nested")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left, text), _pattern_value(node.right, text)
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) != isinstance(right, list):
                raise bad("'+' joins two lists or adds two integers")
            if isinstance(left, list) and len(left) + len(right) > MAX_PATTERN_LENGTH:
                raise bad(f"the list grows past {MAX_PATTERN_LENGTH} entries")
            return left + right
        if isinstance(left, int) and isinstance(right, list):
            left, right = right, left
        if isinstance(left, list) and isinstance(right, int):
            if len(left) * max(right, 0) > MAX_PATTERN_LENGTH:
                raise bad(f"the list grows past {MAX_PATTERN_LENGTH} entries")
            return left * right
        if isinstance(left, int) and isinstance(right, int):
            if abs(left * right) > MAX_PATTERN_LENGTH:
                raise bad(f"a count past {MAX_PATTERN_LENGTH}")
            return left * right
        raise bad("'*' repeats a list by an integer")
    raise bad(f"{type(node).__name__} is not allowed")


def moe_layer_pattern(freq: str | int, num_layers: int) -> list[bool]:
    """Which layers (0-based) are MoE, Megatron's ``moe_layer_freq`` semantics: an int N makes
    layer i MoE when ``i % N == 0``; a list expression gives one 0/1 per layer. The expression
    is parsed, never run: only integer and list literals, ``+`` and ``*`` are evaluated
    (:func:`_pattern_value`)."""
    text = str(freq).strip()
    if text.isdigit():
        every = int(text)
        if every < 1:
            raise ConfigError(f"--moe-layer-freq {freq}: must be at least 1")
        return [i % every == 0 for i in range(num_layers)]
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ConfigError(f"--moe-layer-freq {freq!r}: expected an int or a list expression "
                          f"such as '([0]+[1]*3)*2'") from None
    pattern = _pattern_value(tree.body, text)
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise ConfigError(f"--moe-layer-freq {freq!r}: must give a list of 0/1")
    if len(pattern) != num_layers:
        raise ConfigError(f"--moe-layer-freq {freq!r} gives {len(pattern)} layers, but "
                          f"--num-layers is {num_layers}")
    return [bool(v) for v in pattern]


def expert_ffn_size(config) -> int:
    m = config.model
    return config.moe.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
