"""Refuse MoE settings that cannot run, before any rank starts (exit 2)."""

from __future__ import annotations

from plugtron.api import ConfigError, PluginError, load_plugin

from .options import expert_ffn_size, load_balancing, moe_layer_pattern, uses_sinkhorn


def validate(config, world_size: int) -> None:
    o, m, p = config.moe, config.model, config.parallel
    ep = p.expert_model_parallel_size or 1
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    if not o.num_experts:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs --num-experts (there "
                              f"are no experts to split)")
        if etp != tp:
            raise ConfigError(f"--expert-tensor-parallel-size {etp} needs --num-experts (there "
                              f"are no experts to split)")
        return
    if o.num_experts < 1:
        raise ConfigError(f"--num-experts must be at least 1, got {o.num_experts}")
    mlp = getattr(config, "mlp", None)  # the MLP layer's section, when installed
    if mlp is not None and mlp.squared_relu:
        # The experts implement SwiGLU and GeLU only: accepting the flag would train GeLU
        # experts beside relu^2 dense MLPs.
        raise ConfigError("--squared-relu is not supported for MoE experts (they are SwiGLU "
                          "or GeLU); drop it or --num-experts")
    if o.num_experts % ep:
        raise ConfigError(f"--num-experts {o.num_experts} is not divisible by "
                          f"--expert-model-parallel-size {ep} (each ep rank holds whole experts)")
    if world_size % (etp * ep * pp):
        raise ConfigError(f"world size {world_size} is not divisible by etp {etp} x ep {ep} x "
                          f"pp {pp} = {etp * ep * pp} (expert layout)")
    if not 1 <= o.moe_router_topk <= o.num_experts:
        raise ConfigError(f"--moe-router-topk {o.moe_router_topk} must be in 1.."
                          f"{o.num_experts} (--num-experts)")
    load_balancing(o)  # raises on types and coefficients that do not pair up
    sinkhorn = uses_sinkhorn(o)
    if sinkhorn:
        _check_sinkhorn(o)
    if (o.moe_router_topk == 1 and o.moe_router_score_function == "softmax"
            and not o.moe_router_pre_softmax and not sinkhorn):
        # Softmax over the one chosen logit is 1 whatever the logit: the router's weight would
        # get no gradient from the output (Megatron refuses it the same way).
        raise ConfigError("--moe-router-topk 1 with softmax after top-k gives every token the "
                          "weight 1, so the router learns nothing from the output: add "
                          "--moe-router-pre-softmax (softmax over all experts, then top-1; "
                          "Megatron: 'use --moe-router-pre-softmax when topk is 1'), or use "
                          "--moe-router-score-function sigmoid")
    if o.moe_pad_expert_input_to_capacity and o.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs "
                          "--moe-expert-capacity-factor (the capacity to pad to)")
    if o.moe_expert_capacity_factor is not None and o.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor must be positive, got "
                          f"{o.moe_expert_capacity_factor}")
    groups, group_topk = o.moe_router_num_groups, o.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together")
    if groups is not None:
        if o.num_experts % groups or not 1 <= group_topk <= groups \
                or o.moe_router_topk % group_topk:
            raise ConfigError(f"group-limited routing needs --num-experts {o.num_experts} "
                              f"divisible by --moe-router-num-groups {groups}, 1 <= "
                              f"--moe-router-group-topk {group_topk} <= groups, and "
                              f"--moe-router-topk {o.moe_router_topk} divisible by it")
    if o.moe_router_enable_expert_bias and o.moe_router_score_function == "softmax":
        raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                          "sigmoid or sqrtsoftplus (Megatron's aux-loss-free balancing), not "
                          "softmax")
    if o.moe_shared_expert_gate and not o.moe_shared_expert_intermediate_size:
        raise ConfigError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    for name, size in (("--moe-ffn-hidden-size", expert_ffn_size(config)),
                       ("--moe-shared-expert-intermediate-size",
                        o.moe_shared_expert_intermediate_size)):
        if size and size % etp:
            raise ConfigError(f"{name} {size} is not divisible by the expert tensor-parallel "
                              f"size {etp}")
    cp = p.context_parallel_size or 1
    tokens = m.seq_length // cp * config.training.micro_batch_size  # one rank's microbatch
    if etp != tp and tp > 1 and not p.sequence_parallel and tokens % tp:
        # Without SP the tp ranks share their tokens; for etp != tp each takes 1/tp of them.
        raise ConfigError(f"--expert-tensor-parallel-size {etp} with --tp {tp} and no "
                          f"--sequence-parallel splits a microbatch's {tokens} tokens "
                          f"(--seq-length / cp x --micro-batch-size) over tp, which needs them "
                          f"divisible by {tp}")
    moe_layer_pattern(o.moe_layer_freq, m.num_layers)  # raises on a bad expression
    try:
        load_plugin("moe_dispatcher", o.moe_token_dispatcher_type)
    except PluginError as exc:
        raise ConfigError(f"--moe-token-dispatcher-type: {exc}") from None


def _check_sinkhorn(o) -> None:
    """Sinkhorn routing computes its own weights (softmax, or sigmoid for top-1) and chooses by
    the balanced logits: the options it would silently ignore are refused, as is what
    Megatron refuses with it (a capacity factor)."""
    ignored = [(o.moe_router_score_function != "softmax",
                f"--moe-router-score-function {o.moe_router_score_function}"),
               (o.moe_router_pre_softmax, "--moe-router-pre-softmax"),
               (o.moe_router_num_groups is not None, "--moe-router-num-groups"),
               (bool(o.moe_router_topk_scaling_factor), "--moe-router-topk-scaling-factor"),
               (o.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias")]
    for given, flag in ignored:
        if given:
            raise ConfigError(f"--moe-router-load-balancing-type sinkhorn does not use {flag} "
                              f"(sinkhorn routing weighs by softmax, sigmoid for top-1, and "
                              f"chooses by the balanced logits): drop {flag}, or balance with "
                              f"aux_loss, seq_aux_loss or global_aux_loss")
    if o.moe_expert_capacity_factor is not None:
        raise ConfigError("--moe-expert-capacity-factor works with aux_loss, seq_aux_loss, "
                          "global_aux_loss or none, not sinkhorn (as Megatron): drop it, or "
                          "choose one of those")
