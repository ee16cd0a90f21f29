"""Layer type ``M``: pre-norm Mamba-2 mixer, in pure torch.

Children as in Megatron-Core's MambaLayer, so parameters read ``decoder.layers.{i}.norm.*`` and
``decoder.layers.{i}.mixer.{in_proj,conv1d,A_log,D,dt_bias,norm,out_proj}``.

Tensor parallelism is Megatron's: heads and groups are divided over tp. ``in_proj`` is
column-parallel over its five blocks ``[z, x, B, C, dt]`` (of different sizes, each split over
tp on its own), the depthwise ``conv1d`` and the per-head ``A_log``, ``D``, ``dt_bias`` and the
gated norm are sharded with their channels, and ``out_proj`` is row-parallel. Under sequence
parallelism ``in_proj`` gathers the sequence and ``out_proj`` scatters it again, so the scan
always sees whole sequences of this rank's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import (
    current_forward_context,
    document_runs,
    normal_init,
    scaled_normal_init,
    set_tensor_parallel,
    shard_of,
)
from plugtron_gpt.hybrid.causal_conv import causal_conv_silu
from plugtron_gpt.hybrid.gated_norm import gated_rms_norm
from plugtron_gpt.hybrid.mamba_activations import mamba_layer_bytes
from plugtron_gpt.hybrid.mamba_init import a_log_init, conv_init, dt_bias_init
from plugtron_gpt.hybrid.options import CONV_WIDTH, mamba_sizes
from plugtron_gpt.hybrid.ssd import ssd_final_state, ssd_scan, ssd_step
from plugtron_gpt.layers.attention import dropout


def _sharded(full: torch.Tensor, parallel, blocks=1) -> torch.nn.Parameter:
    """This tp rank's channels (dim 0) of ``full``, declared so checkpoints reshard it."""
    param = torch.nn.Parameter(shard_of(full, 0, parallel.tp_rank, parallel.tp_size, blocks))
    set_tensor_parallel(param, 0, blocks)
    return param


class GatedRMSNorm(torch.nn.Module):
    """``rmsnorm(y x silu(z))`` over each group of channels, times ``weight``: the group
    boundaries match the B/C groups, so the norm never reaches across tp ranks."""

    def __init__(self, channels: int, group_size: int, eps: float, parallel):
        super().__init__()
        self.weight = _sharded(torch.ones(channels), parallel)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)


class DepthwiseCausalConv(torch.nn.Conv1d):
    """Depthwise conv of width 4 over this rank's x, B, C channels; causal (left padding),
    followed by SiLU. A ``Conv1d`` for its parameters only."""

    def __init__(self, blocks: tuple[int, ...], parallel, seed: int, prefix: str):
        local = sum(blocks) // parallel.tp_size
        super().__init__(local, local, CONV_WIDTH, groups=local, padding=CONV_WIDTH - 1)
        full = sum(blocks)
        self.weight = _sharded(conv_init(CONV_WIDTH, seed, f"{prefix}.weight")(
            (full, 1, CONV_WIDTH)), parallel, blocks)
        self.bias = _sharded(conv_init(CONV_WIDTH, seed, f"{prefix}.bias")((full,)), parallel,
                             blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(conv(x))``, ``x``: ``[b, s, channels]`` (the SiLU fused, see causal_conv)."""
        bias = self.bias
        if bias is None:  # Conv1d types it optional; __init__ always sets one
            raise RuntimeError("DepthwiseCausalConv has no bias")
        return causal_conv_silu(x, self.weight, bias)


class MambaMixer(torch.nn.Module):
    """in_proj -> [z, x, B, C, dt]; conv1d + SiLU over x, B, C; SSD scan; D skip; gated norm;
    out_proj (no pre-norm, no residual): ``mixer`` of a Mamba layer."""

    # in_proj/out_proj (backend linears), the conv taps and the gated norm defer to W.
    weight_grads_at_input = ("A_log, D and dt_bias: the SSD scan's autograd computes their "
                             "gradients with the input gradient")

    def __init__(self, config, backend, parallel, prefix: str, seed: int):
        super().__init__()
        m, tp = config.model, parallel.tp_size
        self.cache_key = prefix  # this layer's entry in a generation's recurrent state
        size = mamba_sizes(config)
        inner, groups_state, heads = size["inner"], size["groups"] * size["state"], size["heads"]
        self.heads, self.groups = heads // tp, size["groups"] // tp
        self.head_dim, self.state = size["head_dim"], size["state"]
        self.chunk_size = config.hybrid.chunk_size
        self.dt_limit_min = config.hybrid.dt_limit_min
        self.inner = inner // tp
        self.in_proj = backend.column_parallel_linear(
            m.hidden_size, 2 * inner + 2 * groups_state + heads, bias=False,
            init_method=normal_init(m.init_method_std, seed, f"{prefix}.in_proj.weight"),
            partition_chunks=(inner, inner, groups_state, groups_state, heads))
        self.conv1d = DepthwiseCausalConv((inner, groups_state, groups_state), parallel, seed,
                                          f"{prefix}.conv1d")
        self.A_log = _sharded(a_log_init(seed, f"{prefix}.A_log")((heads,)), parallel)
        self.D = _sharded(torch.ones(heads), parallel)
        self.dt_bias = _sharded(dt_bias_init(seed, f"{prefix}.dt_bias")((heads,)), parallel)
        self.norm = GatedRMSNorm(inner, inner // size["groups"], m.norm_epsilon, parallel)
        self.out_proj = backend.row_parallel_linear(
            inner, m.hidden_size, bias=False,
            init_method=scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                           f"{prefix}.out_proj.weight"),
            input_is_parallel=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        projected, _ = self.in_proj(hidden)
        bc = self.groups * self.state
        z, xbc, dt = projected.split([self.inner, self.inner + 2 * bc, self.heads], dim=-1)
        batch, length = xbc.shape[:2]
        # Generation: left padding becomes a no-op (zero conv input, as the conv's own causal
        # padding; dt = 0: no decay, no input), and with the cache the conv window and SSM
        # state of the tokens so far continue instead of starting from zero.
        context = current_forward_context()
        inference = context.inference
        documents = context.document_ids if inference is None else None
        if documents is not None and bool((documents[:, 1:] != documents[:, :-1]).any()):
            # Packed documents: the conv window and the state start afresh at each boundary,
            # as each document alone would (Megatron's packed sequences for Mamba).
            y = self._per_document(xbc, dt, documents)
            out, _ = self.out_proj(self.norm(y.to(hidden.dtype).flatten(2), z))
            return out
        cached, valid = None, None
        if inference is not None:
            valid = inference.valid(length)
            xbc = xbc * valid[..., None].to(xbc.dtype)
            if inference.use_cache:
                cached = inference.recurrent.get(self.cache_key)
        conv_in = xbc if cached is None else torch.cat([cached[0], xbc], dim=1)
        x, B, C = self.conv1d(conv_in)[:, -length:].split([self.inner, bc, bc], dim=-1)
        # The scan runs in fp32 whatever the training dtype: its decays are exponentials of sums.
        x = x.reshape(batch, length, self.heads, self.head_dim)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_limit_min > 0:
            dt = dt.clamp(min=self.dt_limit_min)
        if valid is not None:
            dt = dt * valid[..., None]
        A = -torch.exp(self.A_log.float())
        B = B.reshape(batch, length, self.groups, self.state).float()
        C = C.reshape(batch, length, self.groups, self.state).float()
        D = self.D.float()
        if cached is None:
            y = ssd_scan(x.float(), dt, A, B, C, self.chunk_size, D)  # D x folded in
        else:
            y, ssm = ssd_step(cached[1], x.float(), dt, A, B, C)
            y = y + x.float() * D[:, None]
        if inference is not None and inference.use_cache:
            if cached is None:
                ssm = ssd_final_state(x.float(), dt, A, B)
            window = F.pad(conv_in, (0, 0, CONV_WIDTH - 1, 0))[:, -(CONV_WIDTH - 1):]
            inference.recurrent[self.cache_key] = (window, ssm)
        y = y.to(hidden.dtype)
        out, _ = self.out_proj(self.norm(y.flatten(2), z))
        return out


    def _per_document(self, xbc: torch.Tensor, dt_raw: torch.Tensor,
                      documents: torch.Tensor) -> torch.Tensor:
        """The conv and scan of each run of equal document numbers on its own (from a zero
        window and state), put back in place: ``[b, l, heads, head_dim]`` in fp32."""
        bc = self.groups * self.state
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        rows = []
        for row, spans in enumerate(document_runs(documents)):
            parts = []
            for start, end in spans:
                x, B, C = self.conv1d(xbc[row:row + 1, start:end]).split(
                    [self.inner, bc, bc], dim=-1)
                n = end - start
                dt = F.softplus(dt_raw[row:row + 1, start:end].float() + self.dt_bias.float())
                if self.dt_limit_min > 0:
                    dt = dt.clamp(min=self.dt_limit_min)
                parts.append(ssd_scan(
                    x.reshape(1, n, self.heads, self.head_dim).float(), dt, A,
                    B.reshape(1, n, self.groups, self.state).float(),
                    C.reshape(1, n, self.groups, self.state).float(), self.chunk_size, D))
            rows.append(torch.cat(parts, dim=1))
        return torch.cat(rows)


class MambaLayer(torch.nn.Module):
    """``hidden + dropout(mixer(norm(hidden)))``."""

    symbol = "M"
    supports_kv_cache = True  # conv window + SSM state in the InferenceState (mixer.forward)

    def __init__(self, config, backend, parallel, layer_number: int, seed: int):
        super().__init__()
        self.backend = backend
        self.norm = backend.norm(config.model.hidden_size)
        self.mixer = MambaMixer(config, backend, parallel,
                                f"decoder.layers.{layer_number - 1}.mixer", seed)
        self.hidden_dropout = config.model.hidden_dropout
        self.normalization = config.model.normalization

    def activation_bytes(self, shape) -> int:
        """Bytes kept for backward per microbatch (``plugtron estimate``)."""
        return mamba_layer_bytes(self, shape)

    def forward(self, hidden: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        out = self.mixer(self.norm(hidden))
        return hidden + dropout(out, self.hidden_dropout, self.training, self.backend)
