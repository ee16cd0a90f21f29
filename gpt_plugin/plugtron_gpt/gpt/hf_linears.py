"""plugtron's fused projections against Hugging Face's separate ones: q, k, v in one
``linear_qkv`` laid out per query group (attention.py), and the PEFT view of each layer's
linears (the converter's ``hf_linear_map``): PEFT's LoRA addresses Llama's ``q_proj`` ..
``down_proj`` where plugtron has ``linear_qkv`` and SwiGLU's ``[gate; up]`` ``linear_fc1``,
both split along the output features as the weights are."""

from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
             groups: int) -> torch.Tensor:
    """Separate q ``[heads*d, ...]``, k and v ``[groups*d, ...]`` into plugtron's per-group
    layout ``[groups * (heads/groups + 2) * d, ...]``."""
    rest = tuple(q.shape[1:])
    d = q.shape[0] // heads
    per = heads // groups
    q = q.reshape(groups, per, d, *rest)
    k = k.reshape(groups, 1, d, *rest)
    v = v.reshape(groups, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int):
    """Inverse of :func:`fuse_qkv`."""
    rest = tuple(qkv.shape[1:])
    per = heads // groups
    d = qkv.shape[0] // (groups * (per + 2))
    x = qkv.reshape(groups, per + 2, d, *rest)
    return (x[:, :per].reshape(heads * d, *rest), x[:, per].reshape(groups * d, *rest),
            x[:, per + 1].reshape(groups * d, *rest))


class LlamaLinears:
    """``modules``: each linear's Hugging Face modules (the converter names them); a tensor
    along a linear's output features splits into theirs and fuses back."""

    def __init__(self, modules: dict[str, list[str]], heads: int, groups: int):
        self.modules, self.heads, self.groups = modules, heads, groups

    def split(self, linear: str, rows: torch.Tensor) -> list[torch.Tensor]:
        if linear.endswith(".linear_qkv"):
            return list(split_qkv(rows, self.heads, self.groups))
        if linear.endswith(".linear_fc1"):
            return list(rows.chunk(2))
        return [rows]

    def fuse(self, linear: str, parts: list[torch.Tensor]) -> torch.Tensor:
        if linear.endswith(".linear_qkv"):
            q, k, v = parts
            return fuse_qkv(q, k, v, self.heads, self.groups)
        return torch.cat(parts)
