"""The routed experts (``mlp.experts``): Megatron-Core's SequentialMLP names, one module per
expert under its *global* index, ``mlp.experts.local_experts.{e}.linear_fc1.weight`` and
``.linear_fc2.weight`` (and biases). A global index makes a checkpoint independent of the
expert-parallel size: resharding over ep is only "which experts does this rank hold".

Each expert is split over etp (``--expert-tensor-parallel-size``, default tp; the expert grid
of ParallelContext) as a column- then row-parallel MLP, but the row reduction is *not* done
here: the expert outputs are partial sums over etp, which the dispatcher's combine reduces
(with the reduction it needs anyway). fc2's bias is added as ``bias / etp`` on every etp rank
so the partial sums add up to one bias, and it is marked ``sequence_parallel``, which for an
expert parameter makes the core sum its gradient over etp.

Expert parameters carry ``allreduce = False``: the core reduces their gradients over the
expert-data-parallel group. ``--moe-grouped-gemm`` computes all local experts at once on the
same parameters, so the two paths are interchangeable and give the same numbers: torch's grouped
mm where it runs (tried once per device and dtype, see :func:`grouped_mm_runs`), else a padded
batched matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.api import (
    EXPERT_PARALLEL_RNG,
    batched_linear,
    grouped_linear,
    linear,
    mark_fused_parts,
    mark_sequence_parallel,
    normal_init,
    recompute,
    recompute_module,
    scaled_normal_init,
    set_tensor_parallel,
    shard_of,
    silu_and_mul,
)

from .options import expert_ffn_size


def local_expert_ids(num_experts: int, ep_size: int, ep_rank: int) -> list[int]:
    """The whole experts this ep rank holds: a contiguous block."""
    per_rank = num_experts // ep_size
    return list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))


class ExpertLinear(torch.nn.Module):
    """A weight (and bias): the grouped path reads them stacked; the looped path calls the
    module, ``(output, None)`` as the layer backend's linears answer, so that what a model
    transform hooks onto it (LoRA's adapters) runs. An expert with such hooks is computed
    looped (:func:`transformed`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.bias = torch.nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        return linear(x, self.weight, bias), None


def transformed(experts: list) -> bool:
    """Whether a model transform hooked an expert's linear (its output is more than the
    weight's): the grouped matmul, which reads the weights alone, would leave it out."""
    return any(e.linear_fc1._forward_hooks or e.linear_fc2._forward_hooks for e in experts)


def _expert_param(param: torch.nn.Parameter) -> None:
    setattr(param, "allreduce", False)  # Megatron's mark of an expert parameter


class ExpertMLP(torch.nn.Module):
    def __init__(self, config, parallel, prefix: str, seed: int, ffn: int | None = None):
        super().__init__()
        m = config.model
        ffn = ffn or expert_ffn_size(config)
        tp, rank = parallel.etp_size, parallel.etp_rank  # experts split over etp, not tp
        chunks = 2 if m.swiglu else 1
        self.swiglu, self.tp_size = m.swiglu, tp
        self.gelu_approximation = gelu_approximation(config)
        self.recompute_act = recompute_module(config, "moe_act")
        w1 = normal_init(m.init_method_std, seed, f"{prefix}.linear_fc1.weight")(
            (ffn * chunks, m.hidden_size))
        w2 = scaled_normal_init(m.init_method_std, m.num_layers, seed,
                                f"{prefix}.linear_fc2.weight")((m.hidden_size, ffn))
        b1 = torch.zeros(ffn * chunks // tp) if m.add_bias_linear else None
        b2 = torch.zeros(m.hidden_size) if m.add_bias_linear else None
        self.linear_fc1 = ExpertLinear(shard_of(w1, 0, rank, tp, chunks), b1)
        self.linear_fc2 = ExpertLinear(shard_of(w2, 1, rank, tp), b2)
        set_tensor_parallel(self.linear_fc1.weight, 0, chunks)
        if m.swiglu:
            mark_fused_parts(self.linear_fc1.weight, (ffn, ffn), kind="gate_up")
        set_tensor_parallel(self.linear_fc2.weight, 1)
        bias1, bias2 = self.linear_fc1.bias, self.linear_fc2.bias
        if bias1 is not None and bias2 is not None:
            set_tensor_parallel(bias1, 0, chunks)
            mark_sequence_parallel(bias2)  # partial per etp rank: sum the grads
        for param in self.parameters():
            _expert_param(param)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        # --recompute-modules moe_act: keep only the fc1 output, not the activation's inputs
        return recompute(self._activation, x) if self.recompute_act else self._activation(x)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return silu_and_mul(x)
        return F.gelu(x, approximate=self.gelu_approximation)

    def fc2_bias(self) -> torch.Tensor | None:
        bias = self.linear_fc2.bias
        return None if bias is None else bias / self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Partial output over etp (summed by the dispatcher's combine)."""
        h = self.activation(self.linear_fc1(x, self.linear_fc1.bias)[0])
        return self.linear_fc2(h, self.fc2_bias())[0]


class SequentialMLP(torch.nn.Module):
    """This rank's experts, looped (default) or as one grouped matmul."""

    def __init__(self, config, parallel, prefix: str, seed: int, expert_ids: list[int]):
        super().__init__()
        self.expert_ids = list(expert_ids)
        self.grouped = bool(config.moe.moe_grouped_gemm)
        self.local_experts = torch.nn.ModuleDict({
            str(e): ExpertMLP(config, parallel, f"{prefix}.local_experts.{e}", seed)
            for e in self.expert_ids})
        self.rng_tracker = None  # the run's tracker, set by the layer (expert RNG stream)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``tokens`` sorted by local expert, ``tokens_per_expert[i]`` rows for the i-th."""
        if self.rng_tracker is not None:
            with self.rng_tracker.fork(EXPERT_PARALLEL_RNG):
                return self._compute(tokens, tokens_per_expert)
        return self._compute(tokens, tokens_per_expert)

    def _compute(self, tokens, counts):
        experts = list(self.local_experts.values())
        if self.grouped and sum(counts) > 0 and not transformed(experts):
            return grouped_forward(experts, tokens, counts)
        outputs = [expert(chunk) for expert, chunk in zip(experts, tokens.split(counts))]
        return torch.cat(outputs) if outputs else tokens


#: (device type, device index, dtype) -> whether torch's grouped mm runs forward and backward.
_GROUPED_MM_RUNS: dict[tuple, bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` works here, found by trying it once per device and dtype
    (forward and backward on a tiny problem) rather than assumed from a version or a device
    name: it exists only in recent torch and has kernels for some devices and dtypes only (CPU
    fp32 and bf16 in torch 2.13, bf16 on recent NVIDIA parts)."""
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_MM_RUNS:
        _GROUPED_MM_RUNS[key] = _try_grouped_mm(device, dtype)
    return _GROUPED_MM_RUNS[key]


def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    mm = getattr(torch, "_grouped_mm", None)
    if mm is None:
        return False
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
        _dense_grad(mm(a, b, offs=offs)).sum().backward()
        return a.grad is not None and b.grad is not None
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. The grouped mm's backward
    refuses a broadcast one (stride 0, as ``out.sum()`` gives), where a plain matmul takes it."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.contiguous()


def _dense_grad(x: torch.Tensor) -> torch.Tensor:
    return _DenseGrad.apply(x)


def _aligned(*sizes: int) -> bool:
    # The grouped mm wants 16-byte aligned strides: inner dimensions multiple of 8 (bf16).
    return all(size % 8 == 0 for size in sizes)


def grouped_forward(experts: list[ExpertMLP], tokens: torch.Tensor,
                    counts: list[int]) -> torch.Tensor:
    """Every local expert in one (grouped or batched) matmul per linear."""
    w1 = torch.stack([e.linear_fc1.weight for e in experts])  # [E, out, H]
    w2 = torch.stack([e.linear_fc2.weight for e in experts])  # [E, H, ffn]
    # every expert has biases, or none has (--add-bias-linear)
    b1: list[torch.Tensor] = [e.linear_fc1.bias for e in experts
                              if e.linear_fc1.bias is not None]
    b2: list[torch.Tensor] = [b for e in experts if (b := e.fc2_bias()) is not None]
    # Under a split backward (zero-bubble schedules) grouped_linear defers the experts' weight
    # gradients to W.
    if (_aligned(w1.shape[1], w1.shape[2], w2.shape[1])
            and grouped_mm_runs(tokens.device, tokens.dtype)):
        offs = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        h = _dense_grad(grouped_linear(tokens, w1, offs))
        if b1:
            h = h + torch.cat([b.expand(n, -1) for b, n in zip(b1, counts)])
        h = experts[0].activation(h)
        out = _dense_grad(grouped_linear(h, w2, offs))
        if b2:
            out = out + torch.cat([b.expand(n, -1) for b, n in zip(b2, counts)])
        return out
    # Batched equivalent: pad each expert's rows to the largest count, one bmm per linear.
    width = max(counts)  # one count per local expert: never empty
    index = torch.cat([torch.arange(n, device=tokens.device) + i * width
                       for i, n in enumerate(counts)])
    padded = tokens.new_zeros(len(experts) * width, tokens.shape[-1])
    padded = padded.index_copy(0, index, tokens).view(len(experts), width, -1)
    h = batched_linear(padded, w1)
    if b1:
        h = h + torch.stack(b1).unsqueeze(1)
    h = experts[0].activation(h)
    out = batched_linear(h, w2)
    if b2:
        out = out + torch.stack(b2).unsqueeze(1)
    return out.reshape(len(experts) * width, -1).index_select(0, index)


def gelu_approximation(config) -> str:
    """The GeLU of the ``-`` layer's ``--openai-gelu`` (tanh) where the run has that option,
    so experts compute the dense MLP's activation."""
    options = getattr(config, "mlp", None)
    return "tanh" if getattr(options, "openai_gelu", False) else "none"
