"""``--optimizer muon``'s options: Megatron-Core's names and defaults
(megatron/core/optimizer/optimizer_config.py), and the checks made before launch."""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import (
    ConfigError,
    ConfigSection,
    opt,
    optimizer_sharding_requested,
    selected_driver,
)

from .newton_schulz import COEFFICIENTS, PRECISIONS, SCALE_MODES, schedule


@dataclass
class MuonOptions:
    muon_momentum: float = opt(0.95, "--muon-momentum", "Muon's momentum (an EMA of the "
                               "gradient).")
    muon_nesterov: bool = opt(False, "--muon-nesterov", "Nesterov momentum in Muon.",
                              is_flag=True)
    muon_split_qkv: bool = opt(True, "--muon-split-qkv", "Orthogonalize a fused QKV "
                               "projection's Q, K and V as three matrices.", is_flag=True,
                               negative="--muon-no-split-qkv")
    muon_split_gate_up: bool = opt(False, "--muon-split-gate-up", "Orthogonalize SwiGLU's "
                                   "fused [gate; up] projection as two matrices (Megatron-Core "
                                   "orthogonalizes it whole).", is_flag=True)
    muon_scale_mode: str = opt("spectral", "--muon-scale-mode", "Scale of the orthogonalized "
                               "update of a rows x cols matrix: spectral sqrt(max(rows, cols)), "
                               "shape_scaling sqrt(max(1, rows/cols)), unit_rms_norm "
                               "sqrt(rows/cols).", choices=SCALE_MODES)
    muon_extra_scale_factor: float = opt(1.0, "--muon-extra-scale-factor", "Extra factor on "
                                         "Muon's update (0.2 with spectral matches AdamW's "
                                         "update RMS).")
    muon_fp32_matmul_prec: str = opt("medium", "--muon-fp32-matmul-prec", "torch's float32 "
                                     "matmul precision of the Newton-Schulz iteration: medium "
                                     "in bf16, fp32 parameters too (as Megatron-Core and "
                                     "torch); high fp32 with TF32 matmuls on CUDA; highest "
                                     "fp32 (equal across layouts).",
                                     choices=tuple(PRECISIONS))
    muon_coefficient_type: str = opt("quintic", "--muon-coefficient-type", "Newton-Schulz "
                                     "coefficients (simple is torch.optim.Muon's).",
                                     choices=tuple(COEFFICIENTS))
    muon_num_ns_steps: int = opt(5, "--muon-num-ns-steps", "Newton-Schulz steps.")
    muon_tp_mode: str = opt("duplicated", "--muon-tp-mode", "Tensor-parallel matrices: "
                            "duplicated gathers each and orthogonalizes it whole on every tp "
                            "rank (the single process's update); distributed runs the "
                            "iteration on the shards, its Gram matrices summed over tp (the "
                            "same update, less compute per rank); blockwise orthogonalizes each "
                            "shard alone (an approximation that changes with tp).",
                            choices=("duplicated", "blockwise", "distributed"))
    muon_scalar_optimizer: str = opt("adam", "--muon-scalar-optimizer", "Optimizer of what "
                                     "Muon leaves (embeddings, output layer, norms, biases): "
                                     "adam (AdamW, --adam-*) or lion (--lion-*).",
                                     choices=("adam", "lion"))
    lion_beta1: float = opt(0.95, "--lion-beta1", "Lion's beta1 (the sign's moment weight).")
    lion_beta2: float = opt(0.98, "--lion-beta2", "Lion's beta2 (the moment's decay).")


SECTION = ConfigSection("muon", MuonOptions, title="Muon")


def validate_muon(config) -> None:
    options = config.muon
    if config.training.fp16:
        raise ConfigError("--optimizer muon with --fp16: not offered (Megatron-Core refuses "
                          "it too); use --bf16")
    if optimizer_sharding_requested(config) and \
            selected_driver(config, "data_parallel") == "fsdp2":
        raise ConfigError("--optimizer muon with --use-distributed-optimizer under fsdp2: fsdp2 "
                          "already shards the state over data parallelism; drop one (the "
                          "layer-wise mode needs the ddp wrapper)")
    if not 0.0 <= options.muon_momentum < 1.0:
        raise ConfigError(f"--muon-momentum must be in [0, 1), got {options.muon_momentum}")
    for flag, beta in (("--lion-beta1", options.lion_beta1),
                       ("--lion-beta2", options.lion_beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {beta}")
    try:
        schedule(options.muon_coefficient_type, options.muon_num_ns_steps)
    except ValueError as exc:
        raise ConfigError(f"--muon-num-ns-steps {options.muon_num_ns_steps} with "
                          f"--muon-coefficient-type {options.muon_coefficient_type}: {exc}") \
            from None
