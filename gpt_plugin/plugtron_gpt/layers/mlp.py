"""Layer type ``-``: pre-norm MLP, GeLU (exact, or tanh with ``--openai-gelu``), SwiGLU or squared ReLU, split column-then-row over tp.

Children as in Megatron-Core, so parameters read ``decoder.layers.{i}.pre_mlp_layernorm.*`` and
``decoder.layers.{i}.mlp.{linear_fc1,linear_fc2}.*``, alone or composed with ``*`` under the same
index (a GPT layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from plugtron.api import (
    ConfigError,
    ConfigSection,
    mark_fused_parts,
    normal_init,
    opt,
    recompute,
    recompute_module,
    scaled_normal_init,
    silu_and_mul,
)
from plugtron_gpt.layers.activations import mlp_layer_bytes, mlp_weight_grad_bytes
from plugtron_gpt.layers.attention import dropout


@dataclass
class MLPOptions:
    squared_relu: bool = opt(False, "--squared-relu",
                             "relu(x)^2 MLP activation, non-gated (Megatron's; NemotronH's relu2).",
                             is_flag=True)
    openai_gelu: bool = opt(False, "--openai-gelu",
                            "GeLU by its tanh approximation (Megatron's; GPT-2's gelu_new) "
                            "instead of the exact erf form.", is_flag=True)


#: Declared by the ``-`` layer type itself, so every model composing it has the option.
SECTION = ConfigSection("mlp", MLPOptions, title="MLP layer (-)")


def squared_relu(config) -> bool:
    """``--squared-relu``; False where the config was built without the section."""
    options = getattr(config, "mlp", None)
    return bool(options and options.squared_relu)


def openai_gelu(config) -> bool:
    """``--openai-gelu``; False where the config was built without the section."""
    options = getattr(config, "mlp", None)
    return bool(options and getattr(options, "openai_gelu", False))


def gelu_approximation(config) -> str:
    """``approximate=`` of ``F.gelu`` for this run's GeLU."""
    return "tanh" if openai_gelu(config) else "none"


class MLP(torch.nn.Module):
    """fc1, activation, fc2 (no norm, no residual): ``mlp`` of a decoder layer."""

    def __init__(self, config, backend, prefix: str, seed: int, ffn: int | None = None):
        super().__init__()
        m = config.model
        ffn = ffn or m.ffn_hidden_size or 4 * m.hidden_size
        self.swiglu = m.swiglu
        self.squared_relu = squared_relu(config)
        self.gelu_approximation = gelu_approximation(config)
        # Init keys are the parameters' final names: the same weights under every layout.
        # SwiGLU's fc1 is [gate; up]: two blocks that tp splits separately.
        self.linear_fc1 = backend.column_parallel_linear(
            m.hidden_size, ffn * (2 if m.swiglu else 1), bias=m.add_bias_linear,
            init_method=normal_init(m.init_method_std, seed, f"{prefix}.linear_fc1.weight"),
            partition_chunks=2 if m.swiglu else 1)
        if m.swiglu:
            mark_fused_parts(self.linear_fc1.weight, (ffn, ffn), kind="gate_up")
        self.linear_fc2 = backend.row_parallel_linear(
            ffn, m.hidden_size, bias=m.add_bias_linear,
            init_method=scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                           f"{prefix}.linear_fc2.weight"),
            input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.linear_fc1(x)
        if self.swiglu:
            x = silu_and_mul(x)
        elif self.squared_relu:
            x = F.relu(x).square()
        else:
            x = F.gelu(x, approximate=self.gelu_approximation)
        out, _ = self.linear_fc2(x)
        return out


class MLPLayer(torch.nn.Module):
    """``hidden + dropout(mlp(pre_mlp_layernorm(hidden)))``."""

    symbol = "-"
    #: The parts --recompute-granularity selective may recompute (--recompute-modules).
    recompute_modules = ("mlp", "layernorm")
    supports_kv_cache = True  # per token: nothing to keep between generation steps
    supports_context_parallel = True  # per token: nothing crosses the sequence

    @staticmethod
    def plugtron_config_sections():
        return [SECTION]

    @staticmethod
    def plugtron_validate(config):
        if squared_relu(config) and config.model.swiglu:
            raise ConfigError("--squared-relu and --swiglu are two MLP activations; choose one")
        if openai_gelu(config) and (squared_relu(config) or config.model.swiglu):
            raise ConfigError("--openai-gelu is an approximation of GeLU; it does not combine "
                              "with --swiglu or --squared-relu (choose one activation)")

    @staticmethod
    def dense_block(config, backend, prefix: str, seed: int, ffn: int | None = None):
        """This layer type's fc1-activation-fc2 block alone (no norm, no residual), ``ffn``
        wide (default the run's ``--ffn-hidden-size``), its weights initialised by their names
        under ``prefix``. For layer types that embed a dense MLP (plugtron-moe's shared
        experts) and find this type by its symbol: the same activation and biases as the run's
        MLP layers, written once."""
        return MLP(config, backend, prefix, seed, ffn)

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        m = config.model
        self.backend = backend
        self.pre_mlp_layernorm = backend.norm(m.hidden_size)
        self.mlp = MLP(config, backend, f"decoder.layers.{layer_number - 1}.mlp", seed)
        self.hidden_dropout = m.hidden_dropout
        self.recompute_norm = recompute_module(config, "layernorm")
        self.recompute_mlp = recompute_module(config, "mlp")
        self.normalization = m.normalization

    def activation_bytes(self, shape) -> int:
        """Bytes kept for backward per microbatch (``plugtron estimate``)."""
        return mlp_layer_bytes(self, shape)

    def weight_grad_bytes(self, shape) -> int:
        """Bytes a split backward keeps from this layer's I to its W (``plugtron estimate``)."""
        return mlp_weight_grad_bytes(self, shape)

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        normed = (recompute(self.pre_mlp_layernorm, hidden) if self.recompute_norm
                  else self.pre_mlp_layernorm(hidden))
        out = recompute(self.mlp, normed) if self.recompute_mlp else self.mlp(normed)
        return hidden + dropout(out, self.hidden_dropout, self.training, self.backend)
